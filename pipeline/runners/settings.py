"""Which settings make two batch runs the same run.

A batch store is resumable: a re-run skips the videos already answered. That is right only when the
re-run would have given the same answers, so a resume must use the settings the store was made
with, bar those that change how fast or where it runs (EXECUTION_KEYS). A re-run with other
settings is refused with one line naming them; `--overwrite` starts the store afresh. `eval`
refuses a store whose streams were answered with different settings (one made before this check,
or written by hand), so a score never mixes runs.
"""
from __future__ import annotations

from typing import Any, Mapping

from arr_coc._validate import ConfigError

# how fast or where a run goes, never what it answers: a resume may change these. decode.fallback
# only says what happens where NVDEC cannot decode (fail or PyAV); stores from before it lack it
EXECUTION_KEYS = frozenset({
    "runtime.device", "runtime.batch_size", "runtime.queue_capacity", "runtime.cuda_graphs", "runtime.cuda_wait",
    "decode.process", "decode.threads", "decode.shared_mb", "decode.fallback",
    "vlm.max_batch", "vlm.max_wait_s", "vlm.cuda_graphs", "vlm.graph_prefill_max_tokens", "vlm.kv_cache_gib",
    "output.chunk_frames",
})
STOCK_KEY = "batch.stock_tokens"   # batch --stock-tokens, recorded beside the pipeline config


def batch_config(config: Mapping[str, Any], stock: bool) -> dict[str, Any]:
    """The config a batch run records (root and streams): the pipeline's, plus batch's own settings."""
    return {**config, "batch": {"stock_tokens": bool(stock)}}


def run_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded config as flat `a.b.c` -> value, without the execution keys. Stores written
    before batch recorded --stock-tokens count as answered without it."""
    flat = dict(_flatten(config))
    flat.setdefault(STOCK_KEY, False)
    return {key: value for key, value in flat.items() if key not in EXECUTION_KEYS}


def differing(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """'key: old -> new' for every setting that differs between two recorded configs, sorted."""
    a, b = run_settings(old), run_settings(new)
    missing = "(unset)"
    return [f"{key}: {a.get(key, missing)} -> {b.get(key, missing)}"
            for key in sorted(set(a) | set(b)) if a.get(key, missing) != b.get(key, missing)]


def check_resumable(store: Any, config: Mapping[str, Any]) -> None:
    """ConfigError (one line) unless `store` was made with the settings of `config`."""
    changes = differing(store.config, config)
    if changes:
        raise ConfigError(f"{store.path} was answered with other settings ({_listing(changes)}); a resume must use "
                          "the same ones: pass --overwrite to start it afresh, or --out a new store")


def check_one_run(where: Any, configs: list[tuple[str, Mapping[str, Any] | None]]) -> None:
    """ConfigError (one line) when the recorded configs of the streams (stream id, config) differ:
    their answers are not one run."""
    known = [(sid, config) for sid, config in configs if config is not None]
    for sid, config in known[1:]:
        changes = differing(known[0][1], config)
        if changes:
            raise ConfigError(f"{where} mixes runs with different settings ({known[0][0]} -> {sid}: "
                              f"{_listing(changes)}); score one run: re-run batch into it with --overwrite, "
                              "or into a new --out")


def _listing(changes: list[str], most: int = 4) -> str:
    more = len(changes) - most
    return "; ".join(changes[:most]) + (f"; and {more} more" if more > 0 else "")


def _flatten(tree: Mapping[str, Any], prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
