// Drives Node client libraries through the proxy and prints, one JSON line per call,
// what the library surfaced: {"id", "text", "error", "message", "status"}.
//
//   node call.mjs CLIENT BASE_URL ['{"stream":false,"turn":"t","prompt":"hi"}']
//       one call, then exit (for a developer trying one client by hand)
//   node call.mjs --serve
//       calls read from stdin, one JSON a line ({"id", "client", "base", "prompt", "stream",
//       "turn", "headers"}), run concurrently; also prints {"id", "first": true} when a call's first
//       text arrives, so that a test can act mid-stream. tests/clients/ uses this mode: one
//       process for the whole session, so two calls 50 ms apart leave 50 ms apart.
import { createInterface } from "node:readline";
import { CLIENTS } from "./clients.mjs";

const print = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

async function run(call) {
  const adapter = CLIENTS[call.client];
  if (!adapter) {
    const known = Object.keys(CLIENTS).join(", ");
    return { id: call.id, text: "", error: "UnknownClient", message: `one of: ${known}`, status: null };
  }
  let text = "";
  let first = false;
  const onText = (piece) => {
    if (!piece) return;
    text += piece;
    if (!first) {
      first = true;
      print({ id: call.id, first: true });
    }
  };
  try {
    const returned = await adapter(call, onText);
    return { id: call.id, text: returned ?? text, error: null, message: "", status: null };
  } catch (err) {
    const named = err?.name && err.name !== "Error" ? err.name : null;
    return {
      id: call.id,
      text: err?.partialText ?? text,
      error: named ?? err?.constructor?.name ?? typeof err,
      message: String(err?.message ?? err),
      status: typeof err?.status === "number" ? err.status : (err?.statusCode ?? null),
    };
  }
}

const [first, base, spec] = process.argv.slice(2);
if (first === "--serve") {
  // Imported before "ready", so that no call pays for an import.
  const libraries = ["openai", "@anthropic-ai/sdk", "@google/genai", "ai", "@ai-sdk/openai", "@ai-sdk/anthropic"];
  await Promise.all(libraries.map((m) => import(m)));
  print({ ready: true });
  const pending = [];
  for await (const line of createInterface({ input: process.stdin })) {
    if (line.trim()) pending.push(run(JSON.parse(line)).then(print));
  }
  await Promise.all(pending);
} else {
  const call = { id: 0, client: first, base, prompt: "hi", stream: true, turn: null };
  print(await run({ ...call, ...JSON.parse(spec ?? "{}") }));
}
