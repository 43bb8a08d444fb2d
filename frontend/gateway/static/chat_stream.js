// The gateway's OpenAI API from the browser: a streamed chat completion read as SSE from fetch(), and errors
// kept as the API's own words (its message, its status, its Retry-After).

/** A refusal or failure from the API, with what a user needs to act on it. */
export class ApiError extends Error {
  constructor(status, message, retryAfter = null) {
    super(message);
    this.status = status; // null when the stream failed after it started (the error came as an SSE event)
    this.retryAfter = retryAfter;
  }

  /** "HTTP 503: <the API's message> (Retry-After: 1 s)": the hint only when the message does not give it already. */
  describe() {
    const prefix = this.status ? `HTTP ${this.status}: ` : "";
    const hint = this.retryAfter && !/retry in/i.test(this.message) ? ` (Retry-After: ${this.retryAfter} s)` : "";
    return `${prefix}${this.message}${hint}`;
  }
}

/** The ApiError of a reply that is not ok, from its OpenAI-shaped body when it has one. */
export async function apiError(reply) {
  let message = reply.statusText || "request failed";
  try {
    message = (await reply.json()).error.message || message;
  } catch {
    // not the API's JSON (a proxy's page): the status says what there is to say
  }
  return new ApiError(reply.status, message, reply.headers.get("Retry-After"));
}

/**
 * Streams POST /v1/chat/completions: yields each chunk (the parsed `data:` JSON) as it arrives. Aborting `signal`
 * closes the connection, and the gateway cancels the generation. Throws ApiError for a refusal or a failed stream.
 */
export async function* streamChat(body, headers, signal) {
  const reply = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...headers },
    body: JSON.stringify(body),
    signal,
  });
  if (!reply.ok) throw await apiError(reply);
  const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue; // keep-alive comments too
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) throw new ApiError(null, chunk.error.message);
      yield chunk;
    }
  }
}
