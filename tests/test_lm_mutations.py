"""The language-model render's suite catches realistic bugs in its own modules.

As tests/test_package_mutations.py does for the image render, but for the modules only a
`task: lm` project has: the transformer (`model.py`), the corpus and its task (`language/text.py`),
the sampler (`generate.py`) and the compression comparison (`language/compress.py`). Each bug is one
a review can miss: attention that sees the future, targets that are not the next byte,
validation taken from the head of the corpus, bits per byte left in nats, a sampler whose
greedy choice is the least likely byte, bytes scored twice by compress. Each must fail the
generated tests named with it; every target must match its module exactly once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mutations import PACKAGE, Mutation, assert_caught, bug, render_to_mutate, run_mutations

TESTS = "test_language_model.py"
SAMPLING = "test_sampling.py"  # generate and compress on a trained GPT

TOKENIZERS, GPT2, PREPARE = "test_tokenizers.py", "test_gpt2_format.py", "test_prepare.py"
LORA = "test_lora.py"
LLAMA = "test_llama.py"

MUTATIONS = [
    # ---- --matrix-optimizer on resume (issue 37) --------------------------------------------
    bug("lm-a-resume-switches-adamw-moments-to-muon", "checkpointing/checkpoint.py",
        'RESUME_FIELDS = (*MODEL_FIELDS, "matrix_optimizer",', "RESUME_FIELDS = (*MODEL_FIELDS,",
        "test_lm_training.py", "optimizer_it_was_trained_with"),
    # ---- LoRA (training/lora.py, issue 54) ---------------------------------------------------
    bug("lm-lora-base-left-trainable", "training/lora.py",
        "param.requires_grad_(False)", "param.requires_grad_(True)",
        LORA, "only_the_adapters"),
    bug("lm-lora-merged-without-alpha-over-rank", "training/lora.py",
        "module.weight += module.lora_scale * delta", "module.weight += delta",
        LORA, "merged_model"),
    bug("lm-lora-resumes-on-any-base", "training/lora.py",
        "    if theirs != ours:", "    if False:",
        LORA, "another_base"),
    # ---- language/tokenizer.py, and bits per byte across tokenizers (issue 37) --
    bug("lm-a-literal-end-of-text-splits-documents", "language/tokenizer.py",
        "self.inner.encode_special_tokens = True", "self.inner.encode_special_tokens = False",
        TOKENIZERS, "gives_back_every_text"),
    bug("lm-bpe-pieces-decoded-token-by-token", "language/tokenizer.py",
        "if byte_level and all(char in BYTE_OF for char in name):", "if False:",
        TOKENIZERS, "gives_back_every_text"),
    bug("lm-documents-run-into-each-other", "language/text.py",
        "ids = ids + ([tokenizer.eot] if tokenizer.eot is not None else [])", "ids = ids",
        TOKENIZERS, "each_document_then"),
    bug("lm-bpe-learns-from-the-held-out-tail", "language/text.py",
        "_training_texts(files, total * (1 - config.data.val_fraction), field)",
        "_training_texts(files, total, field)",
        TOKENIZERS, "training_part_only"),
    bug("lm-bytes-of-the-inputs-not-the-targets", "language/text.py",
        "targets = dataset.starts[:, None] + 1 + torch.arange(dataset.seq_len)",
        "targets = dataset.starts[:, None] + torch.arange(dataset.seq_len)",
        TOKENIZERS, "bits_per_byte_of_its_text"),
    bug("lm-bits-per-token-reported-as-per-byte", "training/task.py",
        'values = {f"{prefix}bpb": record["loss"] / math.log(2) / per_token}',
        'values = {f"{prefix}bpb": record["loss"] / math.log(2)}',
        TOKENIZERS, "bits_per_byte_of_its_text"),
    bug("lm-evaluate-counts-tokens-as-bytes", "evaluate.py",
        "size += sizes[targets].sum()", "size += targets.numel()",
        TOKENIZERS, "bits_per_byte_of_its_text"),
    bug("lm-resume-with-another-tokenizer", "training/task.py",
        'if record.get("tokenizer", "bytes") != self.tokenizer.fingerprint():', "if False:",
        TOKENIZERS, "bits_per_byte_of_its_text"),
    # ---- prepare.py: token files from many sources (issue 37, item 2) -----------------------
    bug("lm-prepare-end-of-text-before-the-document", "prepare.py",
        "_packed(ids + (eot if end is not None else []), self.suffix)",
        "_packed((eot if end is not None else []) + ids, self.suffix)",
        PREPARE, "lands_whole"),
    bug("lm-prepare-counts-bytes-of-tokens-as-tokens", "prepare.py",
        'counts[split]["tokens"] += len(data) // ITEMSIZE[self.suffix]',
        'counts[split]["tokens"] += len(data)',
        PREPARE, "lands_whole"),
    bug("lm-prepare-cuts-a-long-document-at-any-line-break", "prepare.py",
        "cut = CUT.search(document, start + size)",
        'cut = re.compile(rb"(?<=\\n)").search(document, start + size)',
        PREPARE, "long_document"),
    bug("lm-prepare-resume-encodes-everything-again", "prepare.py",
        "done = {unit: encoder.summary(unit) for unit in units}",
        "done = {unit: None for unit in units}",
        PREPARE, "killed_prepare"),
    bug("lm-prepare-held-out-by-place-not-text", "prepare.py",
        'split = "val" if held_out(document, self.fraction) else "train"',
        'split = "val" if held_out(unit.path.name.encode(), self.fraction) else "train"',
        PREPARE, "not_its_place"),
    bug("lm-prepared-folder-read-with-another-tokenizer", "prepare.py",
        "if tokenizer is not None and tokenizer.fingerprint() != own.fingerprint():",
        "if False:",
        PREPARE, "read_a_prepared_folder"),
    # A sixth outside reader's, on prepare (8 of 18 caught at first; these ten survivors and
    # five real bugs caught since):
    bug("outsider-prepare-cuts-after-a-blank-line", "prepare.py",
        'CUT = re.compile(rb"(?<=[!-~]\\n)(?=[!-~])|',
        'CUT = re.compile(rb"(?<=\\n)(?=[!-~])|',
        PREPARE, "long_document"),
    bug("outsider-prepare-counts-a-piece-s-bytes", "prepare.py",
        "yield piece, split, len(document) if number == len(cut) else None",
        "yield piece, split, len(piece) if number == len(cut) else None",
        PREPARE, "long_document"),
    bug("outsider-prepare-folder-in-listing-order", "language/prepared_sources.py",
        "for path in sorted(folder.iterdir()):", "for path in folder.iterdir():",
        PREPARE, "lands_whole"),
    bug("outsider-prepare-edit-of-the-same-size-unseen", "prepare.py",
        'key.update(f"{unit.path.resolve()}\\0{stat.st_size}\\0{stat.st_mtime_ns}\\n".encode())',
        'key.update(f"{unit.path.resolve()}\\0{stat.st_size}\\n".encode())',
        PREPARE, "edited_since"),
    bug("outsider-prepare-first-arrow-file-only", "language/prepared_sources.py",
        'names = [entry["filename"] for entry in files]', 'names = [files[0]["filename"]]',
        PREPARE, "lands_whole"),
    bug("outsider-prepare-null-rows-skipped", "language/prepared_sources.py",
        "                if not isinstance(text, str):\n",
        "                if text is None:\n                    continue\n"
        "                if not isinstance(text, str):\n",
        PREPARE, "bad_sources"),
    bug("outsider-prepare-ids-past-65535-in-16-bits", "prepare.py",
        'return ".u16" if tokenizer.vocab_size <= 65536 else ".i32"',
        'return ".u16" if tokenizer.vocab_size <= 1 << 17 else ".i32"',
        PREPARE, "int32"),
    bug("outsider-prepared-folder-checks-the-kind-not-the-tokenizer", "prepare.py",
        "if tokenizer is not None and tokenizer.fingerprint() != own.fingerprint():",
        "if tokenizer is not None and tokenizer.kind != own.kind:",
        PREPARE, "read_a_prepared_folder"),
    bug("outsider-prepare-a-file-named-twice-read-twice", "language/prepared_sources.py",
        "if real not in seen:", "if True:",
        PREPARE, "lands_whole"),
    bug("outsider-prepare-cuts-a-sentencepiece-document", "prepare.py",
        "self.cuttable = not isinstance(tokenizer, HFTokenizer) or splits_like_gpt2(tokenizer)",
        "self.cuttable = True",
        PREPARE, "another_kind"),
    bug("outsider-prepare-follows-a-link-loop", "language/prepared_sources.py",
        "if path.is_dir() and not path.is_symlink():", "if path.is_dir():",
        PREPARE, "out_folder_inside"),
    bug("outsider-prepare-reads-an-earlier-prepared-folder", "language/prepared_sources.py",
        "    if is_prepared_folder(folder):\n        return",
        "    if False:\n        return",
        PREPARE, "out_folder_inside"),
    # A fifth outside reader's (7 of 12 caught at first; these five, and two real bugs they
    # found, caught since by tests against the library's alphabet, a count by hand, a
    # counting model and transformers):
    bug("outsider-byte-alphabet-misses-0xff", "language/tokenizer.py",
        "*range(0xAE, 0x100)]", "*range(0xAE, 0xFF)]",
        TOKENIZERS, "byte_tokenizer_json"),
    bug("outsider-token-file-named-by-the-tokenizer-kind", "language/text.py",
        'name += "-" + tokenizer.fingerprint()', 'name += "-" + tokenizer.kind',
        TOKENIZERS, "each_document_then"),
    bug("outsider-sampling-goes-on-past-end-of-text", "generate.py",
        "if int(following) == tokenizer.eot:\n                break",
        "if int(following) == tokenizer.eot:\n                continue",
        TOKENIZERS, "first_end_of_text"),
    bug("outsider-compress-counts-the-inputs-bytes", "language/compress.py",
        "size += int(sizes[windows[:, 1:][scored].cpu()].sum())",
        "size += int(sizes[windows[:, :-1][scored].cpu()].sum())",
        TOKENIZERS, "compress_divides"),
    bug("outsider-256-token-tokenizer-read-as-bytes", "prepare.py",
        'if tokenizer.kind == "bytes":\n        return ".u8"',
        'if tokenizer.vocab_size <= 256:\n        return ".u8"',
        TOKENIZERS, "byte_tokenizer_json"),
    bug("outsider-float-causal-masks-read-as-weights", "language/gpt2_format.py",
        'if parts[-2:] in (["attn", "bias"], ["attn", "masked_bias"]):', "if False:",
        GPT2, "old_saves"),
    bug("outsider-untied-head-loaded-over-the-embedding", "language/gpt2_format.py",
        "if head is not None and (token is None or not torch.equal(head, token)):", "if False:",
        GPT2, "old_saves"),
    # ---- language/corpus.py: JSON lines --
    bug("lm-jsonl-blank-lines-read-as-documents", "language/corpus.py",
        "                if line.strip():", "                if True:",
        TOKENIZERS, "jsonl_corpus"),
    bug("lm-jsonl-field-name-ignored", "language/corpus.py",
        "text = record.get(field) if isinstance(record, dict) else None",
        'text = record.get("text") if isinstance(record, dict) else None',
        TOKENIZERS, "jsonl_corpus"),
    # ---- language/gpt2_format.py: GPT-2 folders in and out --
    bug("lm-gpt2-mlp-projection-not-transposed", "language/gpt2_format.py",
        'TRANSPOSED = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")',
        'TRANSPOSED = ("attn.c_attn", "attn.c_proj", "mlp.c_fc")',
        GPT2, "logits_and_greedy"),
    bug("lm-gpt2-gelu-taken-as-exact", "language/gpt2_format.py",
        '"gelu_new": "gelu-tanh",', '"gelu_new": "gelu",',
        GPT2, "logits_and_greedy"),
    bug("lm-gpt2-norms-swapped", "language/gpt2_format.py",
        '"ln_1": "norm1",', '"ln_1": "norm2",',
        GPT2, "logits_and_greedy"),
    bug("lm-exported-head-untied", "language/gpt2_format.py",
        '"tie_word_embeddings": True,', '"tie_word_embeddings": False,',
        GPT2, "exported_checkpoint"),
    bug("lm-export-replaces-an-existing-folder", "language/hf_folders.py",
        "    if out.exists():\n        raise", "    if False:\n        raise",
        GPT2, "refuses_an_existing_folder"),
    # ---- language/llama.py, hf_llama.py, neox_format.py: --model llama, HF folders ----------
    bug("lm-llama-kv-heads-tiled-not-interleaved", "language/llama.py",
        "k = k.repeat_interleave(groups, dim=1)\n            v = v.repeat_interleave(groups, dim=1)",
        "k = k.repeat(1, groups, 1, 1)\n            v = v.repeat(1, groups, 1, 1)",
        LLAMA, "loads_with_its_logits"),
    bug("lm-llama-rms-norm-eps-ignored", "language/llama.py",
        "torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)",
        "torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)",
        LLAMA, "loads_with_its_logits"),
    bug("lm-neox-export-keeps-qkv-rows-unpermuted", "language/neox_format.py",
        "tensor = head_by_head(tensor, heads)", "tensor = tensor",
        LLAMA, "gpt_neox"),
    bug("lm-onnx-parity-compares-eager-with-itself", "runtime/onnx_export.py",
        "got = torch.from_numpy(output).float()",
        "got = model(sample).float()",
        "test_onnx_export.py", "refuses_logits_that_differ"),
    bug("lm-init-from-weights-never-loaded", "train.py",
        "    gpt2_format.init_from(raw_model, config, log)", "    pass",
        GPT2, "fine_tuning_starts"),
    # ---- model.py: causality, weight tying, the FLOPs MFU divides ------------------------
    bug("lm-attention-sees-the-future", "model.py",
        "mask, causal = None, True", "mask, causal = None, False",
        TESTS, "causal_tied or fused_attention"),
    bug("lm-output-layer-not-tied", "model.py",
        "self.head.weight = self.token.weight", "self.head.weight = self.head.weight",
        TESTS, "causal_tied"),
    bug("lm-flops-forget-the-attention", "model.py",
        "return 6 * weights + 12 * len(self.blocks) * width * self.seq_len",
        "return 6 * weights",
        TESTS, "flops_per_token"),
    # ---- language/text.py: windows, the split, the token file, bits per byte, the baseline --
    bug("lm-targets-are-the-inputs", "language/text.py",
        "return window[:-1], window[1:]", "return window[:-1], window[:-1]",
        TESTS, "windows_pair"),
    bug("lm-validation-from-the-head", "language/text.py",
        "train, val = tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]",
        "val, train = tokens[:num_val], tokens[num_val:]",
        TESTS, "windows_pair"),
    bug("lm-token-file-rebuilt-every-run", "language/text.py",
        "    if target.is_file():\n        return target", "    if False:\n        return target",
        TESTS, "built_once"),
    bug("lm-bits-per-byte-left-in-nats", "training/task.py",
        'values = {f"{prefix}bpb": record["loss"] / math.log(2) / per_token}',
        'values = {f"{prefix}bpb": record["loss"] / per_token}',
        TESTS, "metrics_hold_bits"),
    bug("lm-bigram-baseline-unsmoothed", "language/text.py",
        "(counts.double() + 1).log()", "(counts.double() + 1e-9).log()",
        TESTS, "bigram"),
    # ---- generate.py: greedy, top-k, the context window -------------------------------------
    bug("lm-greedy-takes-the-least-likely-byte", "generate.py",
        "return logits.argmax().view(1)", "return logits.argmin().view(1)",
        SAMPLING, "deterministic_by_seed"),
    bug("lm-top-k-ignored", "generate.py",
        "if top_k is not None and top_k < logits.numel():", "if False:",
        SAMPLING, "deterministic_by_seed"),
    bug("lm-sampler-context-not-cropped", "generate.py",
        "logits = model(tokens[:, -seq_len:])[0, -1].float()",
        "logits = model(tokens)[0, -1].float()",
        SAMPLING, "deterministic_by_seed"),
    bug("outsider-generate-feeds-first-window", "generate.py",
        "logits = model(tokens[:, -seq_len:])[0, -1].float()",
        "logits = model(tokens[:, :seq_len])[0, -1].float()",
        SAMPLING, "slides"),
    # ---- the key/value cache, top-p, stop strings (issue 37) -------------------------------
    bug("lm-cache-hides-each-new-position-from-itself", "model.py",
        "mask = seen <= at[:, None]", "mask = seen < at[:, None]",
        "test_generate.py", "cached_forward"),
    bug("lm-cache-positions-start-at-zero", "model.py",
        "positions = torch.arange(start, start + length, device=tokens.device)",
        "positions = torch.arange(length, device=tokens.device)",
        "test_generate.py", "cached_forward"),
    bug("lm-full-cache-restarts-from-a-quarter-window", "generate.py",
        "max(1, seq_len // 2)", "max(1, seq_len // 4)",
        "test_generate.py", "full_cache"),
    bug("lm-stop-string-streamed-before-it-is-found", "generate.py",
        "emitted, hold = 0, max((len(s) - 1 for s in stop), default=0)", "emitted, hold = 0, 0",
        "test_generate.py", "stop_string"),
    bug("lm-top-p-drops-the-byte-that-reaches-p", "generate.py",
        "after = probs.cumsum(-1) - probs >= top_p", "after = probs.cumsum(-1) >= top_p",
        "test_generate.py", "top_p"),
    # ---- rotary positions (issue 37) --------------------------------------------------------
    bug("lm-rope-turns-the-keys-only", "model.py",
        "q, k = rotate(q, angles), rotate(k, angles)", "k = rotate(k, angles)",
        TESTS, "wherever_the_window_starts"),
    bug("lm-rope-one-angle-for-every-pair", "model.py",
        "base ** (-pairs / head_dim)", "base ** (-pairs[:1] / head_dim)",
        TESTS, "rope_turns"),
    # A fourth outside reader's, on step budgets (missed at first; 10 of 12 caught then).
    bug("outsider-max-tokens-count-windows-of-seq-len-plus-one", "language/text.py",
        "math.ceil(tokens / (batch * config.model.seq_len))",
        "math.ceil(tokens / (batch * (config.model.seq_len + 1)))",
        "test_lm_training.py", "max_tokens_counts"),
    bug("outsider-a-step-checkpoint-on-the-budgets-last-step", "checkpointing/checkpointer.py",
        "if run.validates_at(run.global_step):\n            return False",
        "if (run.global_step - run.origin) % run.eval_every == 0:\n            return False",
        "test_lm_training.py", "budgets_last_step"),
    bug("lm-old-checkpoints-taken-as-rope", "checkpointing/checkpoint.py",
        'BEFORE_THE_SETTING = {\n    "position": "learned",\n', "BEFORE_THE_SETTING = {\n",
        "test_lm_training.py", "old_one_is_learned"),
    # ---- best.pt by bits per byte (issue 37) ------------------------------------------------
    bug("lm-best-by-next-byte-accuracy", "training/task.py",
        'best_by = ("val_bpb", False)', 'best_by = ("val_acc", True)',
        "test_lm_training.py", "lowest_validation"),
    bug("lm-best-from-a-non-finite-figure", "training/loop.py",
        "    if not math.isfinite(value):\n        return False",
        "    if False:\n        return False",
        "test_lm_training.py", "lowest_validation"),
    # ---- the non-finite guard on the device (issue 53), with the GPT ----------------------
    bug("lm-guard-applies-the-skipped-update-anyway", "training/loop.py",
        "muon.step_unless(optimizer, skip)", "optimizer.step()",
        "test_nonfinite_guard.py", "foreach"),
    # ---- a third outside reader's (issue 37's code, not its tests): missed at first --------
    bug("outsider-two-new-tokens-through-the-cache-unmasked", "model.py",
        "if length > 1:", "if length > 2:",
        "test_generate.py", "cached_forward"),
    bug("outsider-top-p-mask-gathered-not-scattered", "generate.py",
        "masked_fill(torch.zeros_like(after).scatter(0, order, after),",
        "masked_fill(after[order],",
        "test_generate.py", "top_p"),
    bug("outsider-an-equal-figure-rewrites-best", "training/loop.py",
        "not (value > run.best if higher else value < run.best)",
        "not (value >= run.best if higher else value <= run.best)",
        "test_lm_training.py", "lowest_validation"),
    bug("outsider-only-best-val-acc-checked-on-resume", "checkpointing/checkpoint.py",
        'for key in [key for key in state if str(key).startswith("best_val_")]:',
        'for key in [key for key in state if key == "best_val_acc"]:',
        "test_lm_training.py", "bad_best"),
    # ---- a second outside reader's bugs (not seen the tests) that the fast suite missed ----
    bug("outsider-compress-rescores-first-window-of-each-batch", "language/compress.py",
        "scored[batch == 0] = True", "scored[0] = True",
        SAMPLING, "any_stride_by_hand"),
    bug("outsider-eval-text-windows-skip-a-byte", "evaluate.py",
        "starts = torch.arange(0, len(tokens) - 1, span)",
        "starts = torch.arange(0, len(tokens) - 1, span + 1)",
        "test_evaluate_text.py", "whole_windows"),
    # ---- step checkpoints in the LM render (issue 36) --------------------------------------
    bug("lm-save-every-never-saves-mid-epoch", "checkpointing/checkpointer.py",
        "if run.validates_at(run.global_step):\n            return False",
        "if True:\n            return False",
        "test_step_checkpoints.py", "sigkill or keep_last_keeps"),
    bug("lm-checkpoint-mapped-whole-onto-the-device", "generate.py",
        "state = read_model(path)", "state = read_model(path, device)",
        "test_evaluate_text.py", "onto_the_cpu"),
    bug("lm-evaluate-runs-a-bf16-checkpoint-at-fp32", "evaluate.py",
        "result = bits_per_byte(model, dataset, device, args.batch_size, precision, tokenizer)",
        "result = bits_per_byte(model, dataset, device, args.batch_size, tokenizer=tokenizer)",
        "test_evaluate_text.py", "validation_bits_per_byte"),
    # ---- language/compress.py: each byte scored once, for any stride (issue 36's outside review) -
    bug("lm-compress-scores-the-wrong-tail-off-half-stride", "language/compress.py",
        "scored[:, seq_len - stride :] = True", "scored[:, stride:] = True",
        SAMPLING, "any_stride_by_hand"),
    bug("lm-compress-drops-the-first-window-s-head", "language/compress.py",
        "            scored[batch == 0] = True", "            pass",
        SAMPLING, "any_stride_by_hand"),
    # ---- hostile inputs (issue 53) ----------------------------------------------------------
    bug("lm-prepare-overwrites-a-folder-of-the-users-files", "prepare.py",
        "    refuse_foreign(out)\n", "",
        "test_lm_hostile.py", "users_own_files"),
    bug("lm-prepared-folder-missing-token-file-read-anyway", "prepare.py",
        "    lost = [path for path in files if not path.is_file()]",
        "    lost: list[Path] = []",
        "test_lm_hostile.py", "missing_a_file"),
    # ---- issue 53: planted bugs the fast suite let through ----------------------------------
    bug("lm-prepare-bpe-learns-from-the-held-out-documents", "prepare.py",
        "            if not held_out(document, fraction):\n", "            if True:\n",
        TOKENIZERS, "prepare_s_bpe"),
    bug("lm-prepare-bpe-sample-mb-never-counted-down", "prepare.py",
        "                left -= len(document)\n", "",
        TOKENIZERS, "prepare_s_bpe"),
    bug("lm-epoch-offset-under-two-ranks-mixes-two-epochs", "training/data_sources.py",
        "offset = self.epoch * len(self.dataset)", "offset = self.epoch * self.num_samples",
        "test_lm_training.py", "two_ranks_together"),
]  # fmt: skip


@pytest.fixture(scope="module")
def rendered_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_to_mutate(tmp_path_factory, "lm-mutations", {"task": "lm"})


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest,
    rendered_project: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    return run_mutations(request, rendered_project, MUTATIONS, tmp_path_factory, "LM mutations")


def test_every_lm_only_module_has_mutations(rendered_project: Path) -> None:
    assert (rendered_project / "tests" / TESTS).is_file()
    assert len({mutation.name for mutation in MUTATIONS}) == len(MUTATIONS)
    modules = {"model.py", "language/text.py", "generate.py", "language/compress.py"}
    modules |= {"language/tokenizer.py", "language/gpt2_format.py", "language/corpus.py"}
    assert {mutation.module for mutation in MUTATIONS} >= modules
    assert (rendered_project / "src" / PACKAGE / "language/text.py").is_file()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_a_planted_bug_fails_the_lm_tests(
    outcomes: dict[str, dict[str, Any]], mutation: Mutation
) -> None:
    assert_caught(outcomes, mutation)
