"""Prefix caching's API: the EngineConfig fields, `metrale serve --enable-prefix-caching`, the stats
(`LLM.stats()` through FakeModel) and their export on /metrics."""

from __future__ import annotations

import argparse
import re

import pytest

from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.testing import fake_engine
from metrale_jax.llm import LLM
from metrale_jax.sampling import SamplingParams


def test_config_fields():
    assert EngineConfig().enable_prefix_caching is True  # on by default, as in vLLM
    kw = dict(max_position_embeddings=512, on_gpu=False)
    assert EngineConfig(enable_prefix_caching=True).resolve(**kw, uses_ssm=True).max_ssm_snapshots == 16
    assert EngineConfig(enable_prefix_caching=True, max_ssm_snapshots=3).resolve(**kw, uses_ssm=True
                                                                                  ).max_ssm_snapshots == 3
    assert EngineConfig(enable_prefix_caching=True).resolve(**kw).max_ssm_snapshots == 0  # no SSM state
    assert EngineConfig(max_ssm_snapshots=3, enable_prefix_caching=False).resolve(
        **kw, uses_ssm=True).max_ssm_snapshots == 0  # caching off
    with pytest.raises(ValueError, match="max_ssm_snapshots"):
        EngineConfig(max_ssm_snapshots=-1).resolve(**kw)
    # the host tier: swap copies compiled for it; off without caching
    c = EngineConfig(enable_prefix_caching=True, kv_offloading_size=0.5).resolve(**kw)
    assert c.kv_offloading_size == 0.5 and c.preemption_mode == "recompute" and c.swap_block_buckets
    c = EngineConfig(kv_offloading_size=0.5, enable_prefix_caching=False).resolve(**kw)
    assert c.kv_offloading_size == 0 and not c.swap_block_buckets
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=-1).resolve(**kw)


def test_serve_flags():
    pytest.importorskip("fastapi")
    from metrale_jax.server.cli import add_serve_subcommand, engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_subcommand(p.add_subparsers())
    for argv, on in ((["serve", "m"], True), (["serve", "m", "--enable-prefix-caching"], True),
                     (["serve", "m", "--no-enable-prefix-caching"], False)):
        assert engine_config_from_args(p.parse_args(argv), "m").enable_prefix_caching is on


def test_stats_and_metrics():
    eng = fake_engine(use_ssm=False)  # the default config (prefix caching on); a fresh scheduler
    assert eng.config.enable_prefix_caching
    eng.scheduler = eng._new_scheduler()
    llm = LLM.from_engine(eng)
    prompt = list(range(2, 23))  # 21 tokens: 5 full blocks of 4
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    st = llm.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (21, 0)
    again = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    st = llm.stats()
    assert again == first and (st.prefix_cache_queries, st.prefix_cache_hits) == (42, 20)
    assert llm.reset_prefix_cache() and eng.scheduler.blocks.num_cached == 0
    assert llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids == first
    assert llm.stats().prefix_cache_hits == 20  # nothing cached any more

    pytest.importorskip("prometheus_client")
    from metrale_jax.server.engine_loop import StatsSnapshot
    from metrale_jax.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.attach_engine(lambda: StatsSnapshot.read(eng, 0), lambda: 0)
    text = m.render().decode()
    for name, v in (("metrale_prefix_cache_queries_total", 63), ("metrale_prefix_cache_hits_total", 20)):
        assert re.search(rf"^{name} {v}\.0$", text, re.M), name
    eng.scheduler = eng._new_scheduler()


def test_num_cached_tokens_and_cache_salt():
    """RequestOutput.num_cached_tokens counts the prompt tokens the cache served; vLLM's cache_salt
    (a prompt key) shares blocks only between requests with the same salt."""
    from metrale_jax.errors import InvalidPromptError

    eng = fake_engine(use_ssm=False)
    eng.scheduler = eng._new_scheduler()
    llm = LLM.from_engine(eng)
    prompt = list(range(3, 24))  # 21 tokens: 5 full blocks of 4
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run(**salt):
        o = llm.generate([{"prompt_token_ids": prompt, **salt}], sp)[0]
        return o.num_cached_tokens, o.outputs[0].token_ids

    cold, first = run()
    assert cold == 0
    assert run() == (20, first)  # 5 blocks (the last token is always computed)
    assert run(cache_salt="alice") == (0, first)  # another tenant: nothing shared, same tokens
    assert run(cache_salt="alice") == (20, first)
    assert run(cache_salt="bob")[0] == 0 and run()[0] == 20
    with pytest.raises(InvalidPromptError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": 7}], sp)
    eng.scheduler = eng._new_scheduler()
