"""From a measured ladder to the two profiles and their triggers. Every number comes from a rung of the
ladder or from the user's SLO, and the ``Derivation`` says which, so the runbook can show it.

normal:  max_num_seqs = the recommended concurrency C (left of the knee); the token budget the engine was
         measured with; a queue of C + requests/s at C x the wait a queued request may take (the TTFT SLO,
         else C's p95 end-to-end latency: a request waiting longer than one request's lifetime is late).
protect: the rung below C; half the token budget (smaller prefill chunks: decodes wait less behind long
         prompts); prompts capped at the longest one measured (anything longer is the burst the profile
         guards against); its own queue by the same rule; with a TTFT SLO, prompt tokens waiting capped at
         SLO x the prompt tokens/s measured at C (vLLM's rule for --max-num-queued-tokens); under
         --scheduling-policy priority, requests marked sheddable (priority 1 or more) refused. A 16-bit KV
         cache lists fp8 as a restart-only step, to take after ``pagedserve bench quality`` passes.
triggers: KV usage at the knee's KV level; any preemption in a minute (the recommended rung had none);
         p95 TTFT and ITL at the SLO, else at what the knee rung measured (else twice C's); a queue 80 % full;
         more long prompts in a minute than C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.bench.knee import tightest_slo
from pagedserve.errors import ConfigError
from pagedserve.tune.profiles import Profile, ProfilesFile, Recovery, Trigger, Triggers

FOR_S = 10.0             # a signal must stay past its level this long to switch (one spike never does)
MIN_DWELL_S = 120.0
HOLD_S = 60.0
QUEUE_FULL = 0.8


@dataclass
class Derivation:
    spec: ProfilesFile
    why: dict[str, str] = field(default_factory=dict)     # "profiles.normal.max_num_seqs" -> its source
    recommended: int = 0                                   # rung indices in the ladder
    protect_rung: int = 0
    knee: int | None = None


def derive(doc: dict, config, *, model: str) -> Derivation:
    """``doc``: sweep.json of one concurrency ladder against a server of ``config``."""
    if doc["mode"] != "concurrency":
        raise ConfigError("tune sizes max_num_seqs from a concurrency ladder: use --concurrency, not --request-rates "
                          "or --replay-speeds (bench sweep runs those).")
    lad = doc["ladders"][0]
    rungs, knee = lad["rungs"], lad["knee"]
    r = knee["recommendation"]
    if r is None:
        raise ConfigError(f"The ladder found nothing to recommend: {knee['recommendation_reason']} ({knee['reason']})")
    rec, slo = rungs[r], doc["slo"]
    at = lambda i: f"concurrency {rungs[i]['load']:g}"  # noqa: E731
    why: dict[str, str] = {}

    ttft_slo, itl_slo = tightest_slo(slo, "ttft"), tightest_slo(slo, "itl")
    wait_s = ttft_slo / 1000 if ttft_slo else rec["p95_e2el_ms"] / 1000
    wait_src = f"the TTFT SLO {ttft_slo:g} ms" if ttft_slo else f"p95 E2EL {rec['p95_e2el_ms']:,.0f} ms at {at(r)}"

    def queue_for(profile: str, i: int, running: int) -> int:
        """``running`` + the requests rung i completed a second x the wait a queued request may take."""
        rate = rungs[i]["request_throughput"]
        why[f"profiles.{profile}.max_num_queued_reqs"] = (f"{running} running + {rate:.2f} req/s at {at(i)} x "
                                                         f"{wait_s:.2f} s ({wait_src})")
        return running + math.ceil(rate * wait_s)

    seqs = min(int(rec["load"]), config.max_num_seqs)
    tokens = config.max_num_batched_tokens
    queue = queue_for("normal", r, seqs)
    why["profiles.normal.max_num_seqs"] = f"the recommended rung, {at(r)} ({knee['recommendation_reason']})"
    why["profiles.normal.max_num_batched_tokens"] = "the token budget the ladder was measured with"
    normal = Profile(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_num_queued_reqs=queue)

    p = max(r - 1, 0)
    pseqs = min(int(rungs[p]["load"]), seqs)
    ptokens = max(pseqs, tokens // 2) if config.enable_chunked_prefill else tokens
    pinput = min(max(rung.get("max_input_len", 0) for rung in rungs), config.max_model_len - 1)
    pqueue = queue_for("protect", p, pseqs)
    why["profiles.protect.max_num_seqs"] = f"the rung below the recommended one, {at(p)}"
    why["profiles.protect.max_num_batched_tokens"] = (
        "half the normal budget: smaller prefill chunks, so decodes wait less behind long prompts"
        if config.enable_chunked_prefill else "unchanged: with chunked prefill off it must hold max_model_len")
    why["profiles.protect.max_input_tokens"] = "the longest prompt the ladder measured: longer ones are the burst"
    queued_tokens = None
    if ttft_slo:
        prefill_rate = rec["total_input_tokens"] / rec["duration"]
        queued_tokens = max(pinput, math.ceil(ttft_slo / 1000 * prefill_rate))
        why["profiles.protect.max_num_queued_tokens"] = (f"the TTFT SLO {ttft_slo:g} ms x {prefill_rate:,.0f} prompt "
                                                         f"tokens/s measured at {at(r)}")
    restart = {"kv_cache_dtype": "fp8"} if config.kv_dtype.itemsize > 1 else {}
    shed = 0 if config.args.scheduling_policy == "priority" else None
    if shed is not None:
        why["profiles.protect.max_priority"] = ("requests sent with a priority of 1 or more are the sheddable "
                                                "class: refused with 503 while protect holds (0, the default, "
                                                "and more urgent ones still enter)")
    protect = Profile(max_num_seqs=pseqs, max_num_batched_tokens=ptokens, max_input_tokens=pinput,
                      max_num_queued_reqs=pqueue, max_num_queued_tokens=queued_tokens, max_priority=shed,
                      restart=restart)

    def latency_trigger(metric: str, slo_ms: float | None) -> Trigger:
        key = f"p95_{metric}_ms"
        if slo_ms:
            level, src = slo_ms, f"the SLO {metric}_p95 {slo_ms:g} ms"
        elif knee["knee"] is not None and rungs[knee["knee"]].get(key):
            level, src = rungs[knee["knee"]][key], f"p95 {metric.upper()} measured at the knee, {at(knee['knee'])}"
        else:
            level, src = 2 * rec[key], f"twice the p95 {metric.upper()} at {at(r)} (no knee was reached)"
        why[f"triggers.{metric}_p95_ms"] = src
        return Trigger(above=round(level, 1), for_s=FOR_S)

    kv_level = doc["knee_settings"]["kv_usage"]
    why["triggers.kv_cache_usage"] = (f"the knee's KV-cache level; {at(r)} peaked at "
                                      + ("n/a" if rec.get("server_peak_kv_cache_usage") is None
                                         else f"{100 * rec['server_peak_kv_cache_usage']:.1f} %"))
    why["triggers.preemptions_per_min"] = f"the recommended rung had {rec.get('server_preemptions') or 0:.0f} preemptions"
    why["triggers.queue_depth"] = f"{100 * QUEUE_FULL:.0f} % of normal's queue ({queue - seqs} waiting)"
    why["triggers.long_prompts_per_min"] = (f"more prompts over {pinput} tokens (the longest measured) in a minute "
                                            f"than normal runs at once ({seqs})")
    triggers = Triggers(
        kv_cache_usage=Trigger(above=kv_level, for_s=FOR_S),
        preemptions_per_min=Trigger(above=0.0),
        ttft_p95_ms=latency_trigger("ttft", ttft_slo),
        itl_p95_ms=latency_trigger("itl", itl_slo),
        queue_depth=Trigger(above=round(QUEUE_FULL * (queue - seqs), 2), for_s=FOR_S),
        long_prompts_per_min=Trigger(above=float(seqs)),
        long_prompt_tokens=pinput,
    )
    spec = ProfilesFile(model=model, generated_by=" ".join(doc["command"]), profiles={"normal": normal, "protect": protect},
                        triggers=triggers, recovery=Recovery(min_dwell_s=MIN_DWELL_S, hold_s=HOLD_S))
    return Derivation(spec, why, r, p, knee["knee"])
