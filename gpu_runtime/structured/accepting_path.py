"""Whether a context-free grammar can ever finish: llguidance runs a grammar with no accepting path (`x: "a" x`)
until max_tokens, so such a grammar is refused up front instead.

The grammar is read with the `lark` package (the dialect llguidance's own grammars are written in), and the check
is the textbook one: a rule is productive when one of its expansions is made of terminals and productive rules
only; the grammar can finish when its start rule is productive. Grammars using llguidance's extensions that lark
does not parse (%json, special tokens, ...) are left to llguidance's own checks.
"""

from __future__ import annotations

import lark


def has_accepting_path(lark_grammar: str, start: str = "start") -> bool:
    """False only when lark reads the grammar and its start rule derives no finite string."""
    # The GBNF translator heads its output with llguidance's options line, which is no rule.
    rules_text = "\n".join(line for line in lark_grammar.splitlines() if not line.startswith("%llguidance"))
    try:
        rules = lark.Lark(rules_text, parser="earley", start=start).rules
    except Exception:  # llguidance's dialect goes beyond lark's; its compiler has the last word
        return True
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for rule in rules:
            name = rule.origin.name
            if name in productive:
                continue
            if all(symbol.is_term or symbol.name in productive for symbol in rule.expansion):
                productive.add(name)
                changed = True
    return start in productive
