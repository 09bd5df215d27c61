// An upstream written with Node's own `http` module (no npm packages), for
// tests/test_upstream_servers.py and tests/clients/test_node_upstream_keepalives.py. Node
// writes header names as given (Content-Type, Cache-Control) and adds its own:
// Connection: keep-alive, Keep-Alive: timeout=5,
// Transfer-Encoding: chunked, Date. It compresses as a typical middleware would: br,
// else gzip, whichever the request's Accept-Encoding offers (Node 20 has no zstd).
// Prints {"port": N} once listening on 127.0.0.1.
"use strict";
const http = require("http");
const zlib = require("zlib");

const seen = [];
const closedEarly = []; // x-hold values of held streams whose client closed them
const closeWaiters = [];

function pickEncoding(req) {
  const offered = (req.headers["accept-encoding"] || "").toLowerCase();
  if (/\bbr\b/.test(offered)) return "br";
  if (/\bgzip\b/.test(offered)) return "gzip";
  return null;
}

function encoder(encoding) {
  if (encoding === "br") return zlib.createBrotliCompress();
  if (encoding === "gzip") return zlib.createGzip();
  return null;
}

function events(count, prefix) {
  const out = [];
  for (let i = 0; i < count; i++) {
    const chunk = { object: "chat.completion.chunk", choices: [{ index: 0, delta: { content: `${prefix}${i} ` } }] };
    out.push(`data: ${JSON.stringify(chunk)}\n\n`);
  }
  out.push("data: [DONE]\n\n");
  return out;
}

// The Anthropic Messages stream of the same tokens (for /v1/messages), the first token third.
function anthropicEvents(count, prefix) {
  const sse = (type, data) => `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`;
  const message = {
    id: "msg_node", type: "message", role: "assistant", model: "m", content: [],
    stop_reason: null, stop_sequence: null, usage: { input_tokens: 1, output_tokens: 0 },
  };
  const out = [
    sse("message_start", { message }),
    sse("content_block_start", { index: 0, content_block: { type: "text", text: "" } }),
  ];
  for (let i = 0; i < count; i++) {
    out.push(sse("content_block_delta", { index: 0, delta: { type: "text_delta", text: `${prefix}${i} ` } }));
  }
  out.push(sse("content_block_stop", { index: 0 }));
  out.push(sse("message_delta", { delta: { stop_reason: "end_turn", stop_sequence: null }, usage: { output_tokens: count } }));
  out.push(sse("message_stop", {}));
  return out;
}

function stream(req, res) {
  const encoding = pickEncoding(req);
  const head = { "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Upstream": "node" };
  if (encoding) head["Content-Encoding"] = encoding;
  res.writeHead(200, head);
  const z = encoder(encoding);
  const sink = z || res;
  if (z) z.pipe(res);
  // x-events: how many token events (3 unless asked), each written and flushed on its own;
  // x-prefix: before each token's number ("n" unless asked)
  const count = Number(req.headers["x-events"] || 3);
  const prefix = req.headers["x-prefix"] ?? "n";
  const anthropic = req.url.startsWith("/v1/messages");
  const all = anthropic ? anthropicEvents(count, prefix) : events(count, prefix);
  const flush = () => {
    if (z) z.flush(encoding === "br" ? zlib.constants.BROTLI_OPERATION_FLUSH : zlib.constants.Z_SYNC_FLUSH);
  };
  // x-hold: the events through the first token, then nothing until the client goes (a
  // stalled generation); its early close is recorded for /_stats. With x-keepalive (a
  // JSON string: the exact keep-alive block), that block every x-keepalive-every ms (100)
  // while it holds: a stall behind keep-alives, as OpenRouter or Anthropic send them.
  if (req.headers["x-hold"]) {
    const name = req.headers["x-hold"];
    let timer = null;
    res.on("close", () => {
      if (timer) clearInterval(timer);
      if (res.writableEnded) return;
      closedEarly.push(name);
      for (const waiter of closeWaiters.splice(0)) waiter();
    });
    for (const event of all.slice(0, anthropic ? 3 : 1)) sink.write(event);
    flush();
    if (req.headers["x-keepalive"]) {
      const block = JSON.parse(req.headers["x-keepalive"]);
      timer = setInterval(() => {
        sink.write(block);
        flush();
      }, Number(req.headers["x-keepalive-every"] || 100));
    }
    return;
  }
  let i = 0;
  const next = () => {
    if (i === all.length) return sink.end();
    sink.write(all[i++]);
    // Flush each event as it is written, as an SSE server must.
    if (z) z.flush(encoding === "br" ? zlib.constants.BROTLI_OPERATION_FLUSH : zlib.constants.Z_SYNC_FLUSH, () => setImmediate(next));
    else setImmediate(next);
  };
  next();
}

function whole(req, res) {
  const body = Buffer.from(JSON.stringify({ object: "list", data: [{ id: "node-model" }] }));
  const encoding = pickEncoding(req);
  const payload = encoding === "br" ? zlib.brotliCompressSync(body) : encoding === "gzip" ? zlib.gzipSync(body) : body;
  const head = { "Content-Type": "application/json", "Content-Length": payload.length };
  if (encoding) head["Content-Encoding"] = encoding;
  res.writeHead(200, head);
  res.end(payload);
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    if (req.url.startsWith("/_closed/")) {
      // Answers once the held stream of that name has been closed by its client.
      const name = req.url.slice("/_closed/".length);
      const answer = () => {
        if (!closedEarly.includes(name)) return closeWaiters.push(answer);
        res.writeHead(200, { "Content-Type": "text/plain" });
        res.end("closed");
      };
      answer();
      return;
    }
    if (req.url === "/_stats") {
      res.writeHead(200, { "Content-Type": "application/json" });
      res.end(JSON.stringify({ seen }));
      return;
    }
    seen.push({ url: req.url, headers: req.headers, encoding: pickEncoding(req), port: req.socket.remotePort });
    if (req.url.startsWith("/v1/models")) whole(req, res);
    else stream(req, res);
  });
});
server.listen(0, "127.0.0.1", () => {
  process.stdout.write(JSON.stringify({ port: server.address().port }) + "\n");
});
process.stdin.on("end", () => process.exit(0)); // the test closes stdin: exit with it
process.stdin.resume();
