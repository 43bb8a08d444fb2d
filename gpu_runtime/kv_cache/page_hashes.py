"""Content hashes of full KV pages, chained so that a page's hash stands for every token up to its end."""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 32  # SHA-256: what a page's content hash is (a KV group's key past the first is longer)


def model_salt(model_name: str, generation: str) -> bytes:
    """The salt of a served model's pages: its name and its weights' generation, so that cached pages (and pages
    handed between workers, or indexed by the frontend) never match across models or across two generations."""
    return f"{model_name}:{generation}".encode()


def page_hash(parent: bytes, token_ids: list[int], salt: bytes = b"") -> bytes:
    """The hash of one full page: its parent's hash (b"" for the first page), then its salt, then its tokens.

    Only the first page carries a salt (vLLM's cache_salt does the same): every later hash chains from it, so
    two chains with different salts never meet. SHA-256 makes an accidental collision (which would serve
    another prompt's K/V) negligible, so a hit needs no token-by-token verification.
    """
    digest = hashlib.sha256(parent)
    digest.update(salt)
    digest.update(array("I", token_ids).tobytes())
    return digest.digest()


class PageHasher:
    """Hashes a token stream page by page for one model; `model_salt` keeps one model's pages from another's."""

    def __init__(self, page_size: int, model_salt: bytes):
        self.page_size = page_size
        self.model_salt = model_salt

    def first_page_salt(self, cache_salt: str) -> bytes:
        # A separator keeps ("ab", "c") and ("a", "bc") apart.
        return self.model_salt + b"\0" + cache_salt.encode()

    def extend(self, hashes: list[bytes], token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """Appends to `hashes` the hash of every full page of `token_ids` it does not cover yet; returns it.

        `token_ids` may be a window starting at the first unhashed page (its first token at position
        len(hashes) * page_size), so that a sequence never re-reads the pages it already hashed.
        """
        size = self.page_size
        parent = hashes[-1] if hashes else b""
        for start in range(0, len(token_ids) - size + 1, size):
            salt = b"" if hashes else self.first_page_salt(cache_salt)
            parent = page_hash(parent, token_ids[start : start + size], salt)
            hashes.append(parent)
        return hashes

    def hash_tokens(self, token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The hashes of every full page of a token list (for lookups by content, e.g. exporting a prefix)."""
        return self.extend([], token_ids, cache_salt)
