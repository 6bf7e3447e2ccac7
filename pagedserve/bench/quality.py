"""``pagedserve bench quality``: does a cheaper KV cache (fp8) change what the model says? The same fixed
prompts run greedily on two engines that differ only in ``--kv-cache-dtype``; the candidate is compared
with the reference token by token.

- agreement: the share of each completion generated identically before the first differing token (1.0:
  the same text), averaged over prompts;
- first divergence: where the first differing token sits, for the prompts that diverge;
- |Δ logprob|: of the chosen token, at the positions both engines reached with the same context (after a
  divergence the contexts differ and a comparison would mean nothing);
- top-k overlap: the share of the reference's top-k tokens the candidate also ranks in its top k there;
- perplexity: of the reference's completions, teacher-forced (each engine scores the same prompt +
  completion as a prompt), so every position has the same context on both and no divergence hides a
  difference.

On random (dummy) weights this measures numerical agreement only, not language quality: run it on the
real checkpoint before an fp8 cache goes into a profile.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.bench.datasets import NO_TOKENIZER_VOCAB
from pagedserve.errors import ConfigError

PROMPTS = [
    "The capital of France is",
    "Explain in one paragraph why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three differences between TCP and UDP.",
    "Once upon a time, in a small village by the sea,",
    "Translate to German: The weather is nice today.",
    "What is 17 times 23? Think step by step.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "The three laws of thermodynamics are",
    "A haiku about autumn leaves:",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
    "Give a short definition of continuous batching in LLM serving.",
    "def quicksort(arr):",
    "The most important lesson from the 2008 financial crisis was",
    "Dear customer, thank you for your email regarding",
    "In 1969, the Apollo 11 mission",
]


@dataclass
class QualityResult:
    reference_kv_cache_dtype: str
    kv_cache_dtype: str
    num_prompts: int
    max_tokens: int
    exact_match: float
    agreement: float
    mean_first_divergence: float | None
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    top_k_overlap: float
    reference_perplexity: float
    perplexity: float
    min_agreement: float
    max_logprob_diff: float
    max_perplexity_increase: float
    passed: bool

    @property
    def perplexity_increase(self) -> float:
        return self.perplexity / self.reference_perplexity - 1.0

    def text(self) -> str:
        div = "none" if self.mean_first_divergence is None else f"token {self.mean_first_divergence:.1f} on average"
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join([
            f"KV cache {self.kv_cache_dtype} against {self.reference_kv_cache_dtype}: {self.num_prompts} prompts x "
            f"{self.max_tokens} greedy tokens",
            f"  identical completions:     {100 * self.exact_match:.1f} %",
            f"  agreement before divergence: {100 * self.agreement:.1f} % (threshold >= {100 * self.min_agreement:.0f} %)",
            f"  first divergence:          {div}",
            f"  mean |Δ logprob|:          {self.mean_abs_logprob_diff:.4f} (threshold <= {self.max_logprob_diff:g}); "
            f"max {self.max_abs_logprob_diff:.4f}",
            f"  top-k overlap:             {100 * self.top_k_overlap:.1f} %",
            f"  perplexity (teacher-forced on the reference's completions): {self.perplexity:.4g} against "
            f"{self.reference_perplexity:.4g}, {100 * self.perplexity_increase:+.2f} % (threshold <= "
            f"{100 * self.max_perplexity_increase:+.1f} %)",
            f"Verdict: {verdict}" + ("" if self.passed else ": keep the 16-bit cache, or re-check on the real "
                                                            "checkpoint with calibrated scales"),
        ])


def _run(args, prompts: list | None, num_prompts: int, max_tokens: int, top_k: int,
         texts: list[tuple[list[int], int]] | None = None):
    """Generate on one engine, score ``texts`` (token ids, where the scored part starts; None: this engine's
    own prompts and completions), and free it. ``prompts`` None: the fixed set, as text if the engine has a
    tokenizer, else as fixed random token ids (ids under 256 exist in every vocabulary). Returns the
    completions (token ids, logprobs), the prompts, the texts and their mean negative log-likelihood."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(args))
    try:
        if prompts is None:
            rng = np.random.default_rng(0)
            prompts = ([PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)] if llm.get_tokenizer() is not None
                       else [rng.integers(0, NO_TOKENIZER_VOCAB, size=24).tolist() for _ in range(num_prompts)])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=top_k)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if texts is None:
            texts = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids)) for o in outs]
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        scored = llm.generate([ids for ids, _ in texts], scoring, use_tqdm=False)
        nll = [-s.prompt_logprobs[i][ids[i]].logprob for s, (ids, start) in zip(scored, texts)
               for i in range(start, len(ids))]
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], prompts, texts, float(np.mean(nll))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare(reference, candidate, top_k: int) -> dict:
    """The figures above, from two lists of (token ids, per-position logprob dicts)."""
    agree, divergences, diffs, overlaps = [], [], [], []
    for (ref_ids, ref_lp), (cand_ids, cand_lp) in zip(reference, candidate):
        n = len(ref_ids)
        first = next((i for i, (a, b) in enumerate(zip(ref_ids, cand_ids)) if a != b), None)
        same = n if first is None else first
        agree.append(same / n if n else 1.0)
        if first is not None:
            divergences.append(first)
        # positions with the same context: up to and including the first differing token
        for i in range(min(same + 1, n, len(cand_ids))):
            tok = ref_ids[i]
            if tok in cand_lp[i]:
                diffs.append(abs(ref_lp[i][tok].logprob - cand_lp[i][tok].logprob))
            ref_top = {t for t, lp in ref_lp[i].items() if lp.rank is not None and lp.rank <= top_k}
            cand_top = {t for t, lp in cand_lp[i].items() if lp.rank is not None and lp.rank <= top_k}
            if ref_top:
                overlaps.append(len(ref_top & cand_top) / len(ref_top))
    return {"exact_match": float(np.mean([a == 1.0 for a in agree])), "agreement": float(np.mean(agree)),
            "mean_first_divergence": float(np.mean(divergences)) if divergences else None,
            "mean_abs_logprob_diff": float(np.mean(diffs)) if diffs else 0.0,
            "max_abs_logprob_diff": float(np.max(diffs)) if diffs else 0.0,
            "top_k_overlap": float(np.mean(overlaps)) if overlaps else 1.0}


def run_quality(args, reference_dtype: str, num_prompts: int, max_tokens: int, top_k: int,
                min_agreement: float, max_logprob_diff: float, max_perplexity_increase: float) -> QualityResult:
    """Run the reference engine, free it, run the candidate on the same prompts, compare."""
    if args.kv_cache_dtype == reference_dtype:
        raise ConfigError(f"--kv-cache-dtype {args.kv_cache_dtype} is the reference itself "
                          f"(--reference-kv-cache-dtype): compare a different cache, e.g. fp8.")
    if not 1 <= top_k <= 20:
        raise ConfigError("--top-logprobs must be in [1, 20].")
    if not (0 <= min_agreement <= 1 and max_logprob_diff >= 0 and max_perplexity_increase >= 0):  # nan fails too
        raise ConfigError("--min-agreement must be in [0, 1], --max-logprob-diff and --max-perplexity-increase at "
                          "least 0: a verdict against any other threshold is decided before the run.")
    ref_args = dataclasses.replace(args, kv_cache_dtype=reference_dtype)
    ref_args.create_config()  # a bad flag fails before any model loads
    args.create_config()
    reference, prompts, texts, ref_nll = _run(ref_args, None, num_prompts, max_tokens, top_k)
    candidate, _, _, nll = _run(args, prompts, num_prompts, max_tokens, top_k, texts)
    figures = compare(reference, candidate, top_k)
    ppl_ref, ppl = float(np.exp(ref_nll)), float(np.exp(nll))
    passed = (figures["agreement"] >= min_agreement and figures["mean_abs_logprob_diff"] <= max_logprob_diff
              and ppl / ppl_ref - 1.0 <= max_perplexity_increase)
    return QualityResult(reference_dtype, args.kv_cache_dtype, len(reference), max_tokens, **figures,
                         reference_perplexity=ppl_ref, perplexity=ppl, min_agreement=min_agreement,
                         max_logprob_diff=max_logprob_diff, max_perplexity_increase=max_perplexity_increase,
                         passed=passed)
