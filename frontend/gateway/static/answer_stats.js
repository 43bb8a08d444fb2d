// One answer's figures: time to first token and tokens/s as this browser saw them, the token counts from the
// API's usage (prompt, of which cached, and completion), and how the answer ended.

export class AnswerClock {
  constructor() {
    this.startedAt = performance.now();
    this.firstTokenAt = null;
    this.lastTokenAt = null;
    this.chunks = 0; // chunks with text: the token count while streaming, until usage gives the exact one
  }

  /** Called for each chunk that brought text. */
  sawText() {
    const now = performance.now();
    this.firstTokenAt ??= now;
    this.lastTokenAt = now;
    this.chunks += 1;
  }

  /** The figures so far, as stored with the answer (plain numbers: they survive JSON in local storage). */
  figures(usage, state) {
    const figures = { state, ttftMs: null, tokensPerS: null, completionTokens: usage?.completion_tokens ?? null };
    if (this.firstTokenAt !== null) figures.ttftMs = this.firstTokenAt - this.startedAt;
    const tokens = figures.completionTokens ?? this.chunks;
    // Decode speed: the tokens after the first over the time they took (the first one's wait is the TTFT).
    const decodeS = (this.lastTokenAt - this.firstTokenAt) / 1000;
    if (tokens > 1 && decodeS > 0) figures.tokensPerS = (tokens - 1) / decodeS;
    figures.tokens = tokens;
    if (usage) {
      figures.promptTokens = usage.prompt_tokens;
      figures.cachedTokens = usage.prompt_tokens_details?.cached_tokens ?? 0;
    }
    return figures;
  }
}

/**
 * The stats line: "312 ms to first token · 41.5 tokens/s · prompt 24 (16 cached) · completion 64 · finish: length".
 * state is "waiting", "streaming", a finish reason from the API ("stop", "length", ...), "stopped" or "failed".
 */
export function statsLine(figures) {
  if (!figures) return "";
  const parts = [];
  if (figures.ttftMs !== null) parts.push(`${figures.ttftMs.toFixed(0)} ms to first token`);
  else if (figures.state === "waiting" || figures.state === "streaming") parts.push("waiting for the first token");
  if (figures.tokensPerS !== null) parts.push(`${figures.tokensPerS.toFixed(1)} tokens/s`);
  if (figures.promptTokens !== undefined) {
    parts.push(`prompt ${figures.promptTokens} (${figures.cachedTokens} cached)`);
    parts.push(`completion ${figures.completionTokens}`);
  } else if (figures.tokens) {
    parts.push(`${figures.tokens} tokens`);
  }
  if (figures.state === "stopped") parts.push("stopped");
  else if (figures.state === "failed") parts.push("failed");
  else if (figures.state !== "waiting" && figures.state !== "streaming") parts.push(`finish: ${figures.state}`);
  return parts.join(" · ");
}
