"""lm-evaluation-harness against tokend: a multiple-choice (loglikelihood) task on a local dataset, scored once by
the harness's `local-completions` model against a real `tokend serve` and once by its own `hf` backend on the same
checkpoint; prints one JSON line: each backend's accuracy, the largest per-choice log-likelihood difference, and
whether greedy flags and accuracies agree. Exit status 0 when they agree within --tolerance.

    scripts/check_lm_eval.py                      # SmolLM2-135M-Instruct (the default model), 40 questions
    scripts/check_lm_eval.py --model DIR --questions 100

local-completions sends what evaluation harnesses send to score answers: token-id prompts (context + answer),
echo, logprobs=1, max_tokens=1; the answer's log-likelihood is the sum of its tokens' prompt logprobs. The `hf`
backend runs transformers in this process, float32 on the CPU. lm-eval is installed into this interpreter's
environment on first use (pip; about 20 s).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from harness.local_daemon import LocalDaemon  # noqa: E402

from gpu_runtime.default_model import resolve_model_dir, served_name  # noqa: E402

LM_EVAL = "lm-eval[api]>=0.4.9,<0.5"
TASK = "tokend_arithmetic_choice"
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def main() -> int:
    args = _parse_args()
    _ensure_lm_eval()
    model_dir = resolve_model_dir(args.model, "none")  # the float checkpoint: the one transformers reads too
    with tempfile.TemporaryDirectory(prefix="tokend-lm-eval-") as work:
        work = Path(work)
        _write_task(work, args.questions, args.seed)
        name = served_name(args.model)
        with LocalDaemon("--model", str(model_dir), "--served-model-name", name, "--device", "cpu") as daemon:
            served = _evaluate(
                work,
                "local-completions",
                f"model={name},base_url={daemon.http_url}/v1/completions,"
                f"tokenizer={model_dir},tokenized_requests=True,num_concurrent=4,max_retries=1",
            )
        reference = _evaluate(work, "hf", f"pretrained={model_dir},dtype=float32")
    deltas = [abs(a - b) for a, b in zip(served["loglikelihoods"], reference["loglikelihoods"], strict=True)]
    report = {
        "check": "lm_eval",
        "model": str(model_dir),
        "questions": args.questions,
        "choices_scored": len(deltas),
        "accuracy_tokend": served["acc"],
        "accuracy_hf": reference["acc"],
        "max_abs_loglikelihood_delta": max(deltas),
        "greedy_flags_equal": served["greedy"] == reference["greedy"],
    }
    report["ok"] = (
        report["max_abs_loglikelihood_delta"] <= args.tolerance
        and report["accuracy_tokend"] == report["accuracy_hf"]
        and report["greedy_flags_equal"]
    )
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint directory or a built-in name (default: SmolLM2)")
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest per-choice log-likelihood delta")
    return parser.parse_args()


def _ensure_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
        import tenacity  # noqa: F401  (its api extra: what local-completions needs)
    except ImportError:
        print(f"check_lm_eval: installing {LM_EVAL} (first use)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", LM_EVAL], check=True)


def _write_task(work: Path, count: int, seed: int) -> None:
    """Arithmetic questions with four numeric choices: the dataset (JSON lines) and its task's YAML."""
    rng = random.Random(seed)
    with (work / "questions.jsonl").open("w") as out:
        for _ in range(count):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            right = a + b
            wrong = rng.sample([n for n in range(max(2, right - 9), right + 10) if n != right], 3)
            choices = [str(n) for n in [right, *wrong]]
            rng.shuffle(choices)
            out.write(json.dumps({"question": f"What is {a} plus {b}?", "choices": [f" {c}" for c in choices],
                                  "answer": choices.index(str(right))}) + "\n")  # fmt: skip
    (work / f"{TASK}.yaml").write_text(TASK_YAML.replace("{data}", str(work / "questions.jsonl")))


def _evaluate(work: Path, model: str, model_args: str) -> dict:
    """One lm-eval run of the task: its accuracy and, per (question, choice), the log-likelihood and greedy flag."""
    out = work / model
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
               "--include_path", str(work), "--log_samples", "--output_path", str(out),
               "--batch_size", "4", "--device", "cpu"]  # fmt: skip
    subprocess.run(command, check=True, stdout=sys.stderr)
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda row: row["doc_id"])
    loglikelihoods = [float(resp[0][0]) for row in rows for resp in row["resps"]]
    greedy = [bool(resp[0][1]) for row in rows for resp in row["resps"]]
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    return {"acc": acc, "loglikelihoods": loglikelihoods, "greedy": greedy}


if __name__ == "__main__":
    sys.exit(main())
