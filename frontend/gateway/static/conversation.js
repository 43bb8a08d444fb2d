// The conversation: a system prompt and its turns, kept in local storage so that a reload or a new tab finds it
// again, until the user clears it. A turn is {role: "user" | "assistant", content, figures?, error?}; an answer
// that failed stays on screen with its error but is never sent back to the model.

const STORAGE = "tokend.playground.conversation";

export class Conversation {
  constructor(system = "", turns = []) {
    this.system = system;
    this.turns = turns;
  }

  static restore() {
    try {
      const saved = JSON.parse(localStorage.getItem(STORAGE) ?? "null");
      if (saved && typeof saved.system === "string" && Array.isArray(saved.turns)) {
        return new Conversation(saved.system, saved.turns.filter(isTurn));
      }
    } catch {
      // unreadable: start afresh
    }
    return new Conversation();
  }

  save() {
    try {
      localStorage.setItem(STORAGE, JSON.stringify({ system: this.system, turns: this.turns }));
    } catch {
      // storage full or refused (a private window): the conversation still lives in the page
    }
  }

  /** Forgets the turns, here and in storage; the system prompt stays: it is more setting than conversation. */
  clear() {
    this.turns = [];
    this.save();
  }

  /** The messages a request sends: the system prompt if any, then every turn but failed answers. */
  messages() {
    const messages = this.system.trim() ? [{ role: "system", content: this.system }] : [];
    for (const turn of this.turns) {
      if (!turn.error) messages.push({ role: turn.role, content: turn.content });
    }
    return messages;
  }

  /** Drops failed answers at the end, so that a retry starts from the last good turn. */
  dropFailedTail() {
    while (this.turns.length && this.turns.at(-1).error) this.turns.pop();
  }

  /** Whether the last good turn is the user's: then Send with an empty box sends it again. */
  awaitsAnswer() {
    const good = this.turns.filter((turn) => !turn.error);
    return good.length > 0 && good.at(-1).role === "user";
  }

  /** Removes the last user turn and everything after it, and returns its text (null if there is none). */
  takeBackLastUserTurn() {
    const index = this.turns.findLastIndex((turn) => turn.role === "user");
    if (index < 0) return null;
    const text = this.turns[index].content;
    this.turns = this.turns.slice(0, index);
    return text;
  }
}

function isTurn(turn) {
  return turn && (turn.role === "user" || turn.role === "assistant") && typeof turn.content === "string";
}
