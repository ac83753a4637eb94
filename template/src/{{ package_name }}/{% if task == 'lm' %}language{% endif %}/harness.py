"""Downstream tasks through EleutherAI's lm-evaluation-harness: `evaluate --tasks NAME,...`.

    python -m <package>.evaluate --tasks hellaswag,arc_easy --limit 100
    python -m <package>.evaluate --tasks my_task --tasks-path my_tasks/

The checkpoint's model is an lm-eval `LM` (`ProjectLM`) read with the checkpoint's own
tokenizer (bytes, the trained BPE, or an --init-from folder's): `loglikelihood` sums the
log-probabilities of a continuation's tokens after its context (in batches; a pair longer than
the model's window loses context from the left) and says whether each token was the likeliest;
`loglikelihood_rolling` scores a whole document in windows of the model's length, each token
once, with as much context as fits; `generate_until` is `generate.sample` (greedy unless a
task asks to sample; the KV cache) up to the first stop string or `max_gen_toks` tokens.
Context and continuation are tokenized together and split as lm-eval's own backends do, so a
GPT-2 folder written by `export --format hf` scores the same under its Hugging Face backend.

Task names are lm-eval's (`lm-eval ls tasks`) or those of the task YAML files under
`--tasks-path`; names found there need no index of lm-eval's own some 15,000 files (seconds).
lm-eval comes with the `eval` extra and is imported only here, when `--tasks` is given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError
from lm_eval import evaluator, utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.tasks import TaskManager
from torch import nn

from ..generate import sample
from ..runtime import accelerator, files
from ..settings.base import ConfigError
from .tokenizer import Tokenizer

MAX_GEN_TOKS = 256  # lm-eval's default for a task that names no max_gen_toks
# A pair as lm-eval hands it to `_loglikelihood_tokens`: the texts, the context's tokens and
# the continuation's.
Tokens = list[int]
Pair = tuple[Any, Tokens, Tokens]


class ProjectLM(TemplateLM):
    """The project's model and tokenizer as an lm-eval language model."""

    backend = "causal"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        device: torch.device,
        batch_size: int = 32,
        precision: str = "fp32",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.codec = tokenizer  # `tokenizer` is lm-eval's name for a Hugging Face tokenizer
        self.max_length = seq_len
        self.batch_size = batch_size
        self.precision = precision
        self._device = device
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def eot_token_id(self) -> int:
        """The end-of-text token, else a model folder's first eos token; a tokenizer without
        either (bytes) starts texts with a newline, as `generate` does."""
        ends = [self.codec.eot] if self.codec.eot is not None else sorted(self.codec.eos_ids)
        return ends[0] if ends else self.codec.encode(b"\n")[0]

    @property
    def tokenizer_name(self) -> str:
        return self.codec.fingerprint()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> Tokens:
        return self.codec.encode(string.encode("utf-8", errors="surrogateescape"))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens).decode("utf-8", errors="replace")

    def _loglikelihood_tokens(
        self, requests: list[Pair], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether each of its tokens is the
        likeliest) per pair, the longest first in batches of `batch_size`."""
        inputs = [self.window(context, continuation) for _, context, continuation in requests]
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            logits = self.logits([inputs[i] for i in chunk])
            for row, index in enumerate(chunk):
                continuation = requests[index][2]
                end = len(inputs[index])  # output k predicts token k + 1 of context + continuation
                scores = logits[row, end - len(continuation) : end].float().log_softmax(-1)
                targets = torch.tensor(continuation, device=scores.device)
                total = scores.gather(-1, targets[:, None]).sum()
                greedy = bool((scores.argmax(-1) == targets).all())
                results[index] = (float(total), greedy)
        return results

    def window(self, context: Tokens, continuation: Tokens) -> Tokens:
        """The model's input for a pair: context and continuation less the last token,
        the context cut from the left to fit the window."""
        if not 0 < len(continuation) <= self.max_length:
            raise ConfigError(
                f"a task's continuation of {len(continuation)} tokens cannot be scored in the "
                f"model's window of {self.max_length}"
            )
        return (context + continuation)[-(self.max_length + 1) :][:-1]

    @torch.inference_mode()
    def logits(self, rows: list[Tokens]) -> torch.Tensor:
        """The model's logits for token rows of lengths up to its window, padded on the right
        (a causal model's outputs before the padding do not see it)."""
        batch = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, : len(row)] = torch.tensor(row)
        with accelerator.autocast(self._device, self.precision):
            return self.model(batch.to(self._device))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood: every token predicted once after the prefix token,
        in windows of the model's length, the last one with as much context as fits."""
        pairs: list[Pair] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            windows = utils.get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(utils.make_disjoint_window, windows):
                pairs.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(pairs), strict=True):
            totals[owner] += score
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """`generate.sample` after each context: greedy unless the task samples, ending
        before the first of its stop strings or after its `max_gen_toks` tokens."""
        texts = []
        for request in requests:
            context, raw = request.args
            kwargs = normalize_gen_kwargs(dict(raw), MAX_GEN_TOKS)
            stops = [s.encode("utf-8") for s in kwargs.get("until", []) if s]
            generated = sample(
                self.model,
                context.encode("utf-8", errors="surrogateescape"),
                max_new_tokens=int(kwargs["max_gen_toks"]),
                temperature=float(kwargs.get("temperature", 0.0)),
                top_k=kwargs.get("top_k") or None,  # 0: no top-k, as in transformers
                top_p=kwargs.get("top_p"),
                stop=stops,
                generator=self.generator,
                seq_len=self.max_length,
                tokenizer=self.codec,
            )
            texts.append(generated.decode("utf-8", errors="replace"))
        return texts


def task_index(tasks_path: Path | None, built_in: bool) -> Any:
    """lm-eval's index of the task YAML files under `tasks_path` and, with `built_in`, of
    its own tasks."""
    return TaskManager(include_path=tasks_path and str(tasks_path), include_defaults=built_in)


def find_tasks(names: list[str], tasks_path: Path | None) -> tuple[Any, list[str]]:
    """The index that knows every name (a glob such as `arc_*` too) and the task names they
    stand for; one line naming where to look for a name no index knows."""
    if tasks_path is not None:
        if not tasks_path.is_dir():
            raise ConfigError(f"--tasks-path {tasks_path} is not a folder of task YAML files")
        local = task_index(tasks_path, built_in=False)
        if all(local.match_tasks([name]) for name in names):
            return local, local.match_tasks(names)
    index = task_index(tasks_path, built_in=True)
    unknown = [name for name in names if not index.match_tasks([name])]
    if unknown:
        where = "" if tasks_path is None else f" nor a task YAML's under --tasks-path {tasks_path}"
        raise ConfigError(
            f"unknown task {', '.join(unknown)}: not one of lm-eval's tasks{where} (list them: "
            "lm-eval ls tasks; a task of your own: a YAML file in a folder given as --tasks-path)"
        )
    return index, index.match_tasks(names)


def run_tasks(
    lm: ProjectLM,
    names: list[str],
    *,
    tasks_path: Path | None,
    num_fewshot: int | None,
    limit: float | None,
) -> dict[str, Any]:
    """lm-eval's results for the tasks (`simple_evaluate`), without per-example samples."""
    index, tasks = find_tasks(names, tasks_path)
    try:
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=int(limit) if limit is not None and limit >= 1 else limit,
            task_manager=index,
            log_samples=False,
        )
    except (FileNotFoundError, ConnectionError) as error:  # a task's data: a path, the hub
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        problem = f"--tasks {','.join(names)}: a task's data cannot be read ({first})"
        raise ConfigError(problem) from None
    except TemplateError as error:  # a task YAML's doc_to_text naming a field the data lacks
        problem = f"--tasks {','.join(names)}: a task's template failed on its data ({error})"
        raise ConfigError(problem) from None
    if results is None:  # only ranks other than 0 of a distributed run get None
        raise ConfigError("lm-eval returned no results")
    results.pop("samples", None)
    return dict(results)


def write_results(results: dict[str, Any], out: Path) -> str:
    """The results as JSON at `out` and as lm-eval's markdown table beside it (`.md`); the
    table."""
    table = utils.make_table(results)
    if results.get("groups"):
        table += "\n" + utils.make_table(results, "groups")
    text = json.dumps(results, indent=2, default=utils.handle_non_serializable)
    files.write_atomically(out, text, "--out")
    files.write_atomically(out.with_suffix(".md"), table, "--out")
    return str(table)
