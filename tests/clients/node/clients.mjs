// Node client libraries as the scenarios drive them: one call per request, with each
// library's DEFAULT retry settings, reporting what the library surfaced to its user.
// Each adapter: async (call, onText) => text, or throws what the library raised.
// `call` is {base, prompt, stream, turn}; onText(piece) is called per piece of text.

const API_KEY = "sk-streamfence-client-test";
globalThis.AI_SDK_LOG_WARNINGS = false; // "model m is unknown": it is, on purpose

const headers = (call) => ({ ...(call.headers ?? {}), ...(call.turn ? { "X-Turn-Id": call.turn } : {}) });
const messages = (call) => [{ role: "user", content: call.prompt }];

async function openaiClient(call) {
  const { default: OpenAI } = await import("openai");
  return new OpenAI({ baseURL: `${call.base}/v1`, apiKey: API_KEY, defaultHeaders: headers(call) });
}

// The Vercel AI SDK reports a stream's errors as `error` parts rather than throwing
// from the stream: those are what its user sees, so they become the call's error.
async function aiSdk(model, call, onText) {
  const { streamText, generateText } = await import("ai");
  if (!call.stream) {
    const done = await generateText({ model, prompt: call.prompt, maxOutputTokens: 64 });
    onText(done.text);
    return done.text;
  }
  const result = streamText({ model, prompt: call.prompt, maxOutputTokens: 64, onError: () => {} });
  let text = "";
  for await (const part of result.fullStream) {
    if (part.type === "text-delta") {
      text += part.text;
      onText(part.text);
    } else if (part.type === "error") {
      throw Object.assign(asError(part.error), { partialText: text });
    }
  }
  return text;
}

// An error part may carry a plain object (the provider's parsed error chunk).
function asError(value) {
  if (value instanceof Error) return value;
  const message = value?.message ?? JSON.stringify(value);
  const err = new Error(message);
  err.name = `${value?.constructor?.name ?? typeof value}(error part)`;
  err.reported = value;
  return err;
}

export const CLIENTS = {
  async "node-openai-chat"(call, onText) {
    const client = await openaiClient(call);
    if (!call.stream) {
      const done = await client.chat.completions.create({ model: "m", messages: messages(call) });
      onText(done.choices[0].message.content);
      return done.choices[0].message.content;
    }
    const stream = await client.chat.completions.create({
      model: "m",
      messages: messages(call),
      stream: true,
    });
    let text = "";
    for await (const chunk of stream) {
      for (const choice of chunk.choices ?? []) {
        const piece = choice.delta?.content ?? "";
        text += piece;
        if (piece) onText(piece);
      }
    }
    return text;
  },

  async "node-openai-responses"(call, onText) {
    const client = await openaiClient(call);
    if (!call.stream) {
      const done = await client.responses.create({ model: "m", input: call.prompt });
      onText(done.output_text);
      return done.output_text;
    }
    const stream = await client.responses.create({ model: "m", input: call.prompt, stream: true });
    let text = "";
    for await (const event of stream) {
      if (event.type === "response.output_text.delta") {
        text += event.delta;
        onText(event.delta);
      }
    }
    return text;
  },

  async "node-anthropic"(call, onText) {
    const { default: Anthropic } = await import("@anthropic-ai/sdk");
    const client = new Anthropic({ baseURL: call.base, apiKey: API_KEY, defaultHeaders: headers(call) });
    const params = { model: "m", max_tokens: 64, messages: messages(call) };
    if (!call.stream) {
      const done = await client.messages.create(params);
      const text = done.content.map((b) => b.text ?? "").join("");
      onText(text);
      return text;
    }
    const stream = await client.messages.create({ ...params, stream: true });
    let text = "";
    for await (const event of stream) {
      if (event.type === "content_block_delta" && event.delta.type === "text_delta") {
        text += event.delta.text;
        onText(event.delta.text);
      }
    }
    return text;
  },

  async "node-google-genai"(call, onText) {
    const { GoogleGenAI } = await import("@google/genai");
    const ai = new GoogleGenAI({ apiKey: API_KEY, httpOptions: { baseUrl: call.base, headers: headers(call) } });
    if (!call.stream) {
      const done = await ai.models.generateContent({ model: "m", contents: call.prompt });
      onText(done.text ?? "");
      return done.text ?? "";
    }
    const stream = await ai.models.generateContentStream({ model: "m", contents: call.prompt });
    let text = "";
    for await (const chunk of stream) {
      const piece = chunk.text ?? "";
      text += piece;
      if (piece) onText(piece);
    }
    return text;
  },

  async "node-ai-sdk-openai-chat"(call, onText) {
    const { createOpenAI } = await import("@ai-sdk/openai");
    const provider = createOpenAI({ baseURL: `${call.base}/v1`, apiKey: API_KEY, headers: headers(call) });
    return aiSdk(provider.chat("m"), call, onText);
  },

  async "node-ai-sdk-openai-responses"(call, onText) {
    const { createOpenAI } = await import("@ai-sdk/openai");
    const provider = createOpenAI({ baseURL: `${call.base}/v1`, apiKey: API_KEY, headers: headers(call) });
    return aiSdk(provider.responses("m"), call, onText);
  },

  async "node-ai-sdk-anthropic"(call, onText) {
    const { createAnthropic } = await import("@ai-sdk/anthropic");
    const provider = createAnthropic({ baseURL: `${call.base}/v1`, apiKey: API_KEY, headers: headers(call) });
    return aiSdk(provider("m"), call, onText);
  },
};
