"""The checks across settings (service/config_checks.py): a limit given above the one that bounds it stops the start
with a message naming both settings and the fix (exit 2); one left at its default follows the bounding setting."""

from __future__ import annotations

import json
import os

import pytest

from convserve.service.cli import main as cli_main
from convserve.service.config import ConfigError, load_settings
from convserve.service.engine.config import DEFAULTS, EngineConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CONVSERVE_"):
            monkeypatch.delenv(k)


# --- decode_buckets against max_batch_size

@pytest.mark.parametrize("given", [{"decode_buckets": "1,2,4,8,16", "max_batch_size": "8"},
                                   {"decode_buckets": "1,64,512"}],            # above the default max_batch_size
                         ids=["both-given", "buckets-given"])
def test_decode_buckets_given_above_max_batch_size_are_refused_naming_both_and_the_fix(given):
    with pytest.raises(ConfigError) as e:
        load_settings(given)
    msg = str(e.value)
    most = int(given.get("max_batch_size", DEFAULTS.max_batch_size))
    over = [b for b in map(int, given["decode_buckets"].split(",")) if b > most]
    assert f"decode_buckets {', '.join(map(str, over))} exceed max_batch_size ({most})" in msg, msg
    fit = [b for b in map(int, given["decode_buckets"].split(",")) if b < most] + [most]
    assert f"decode_buckets {','.join(map(str, fit))}" in msg and f"raise max_batch_size to {over[-1]}" in msg


def test_decode_buckets_from_the_environment_or_a_file_are_given_too(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('decode_buckets = "1,2,16"\n')
    with pytest.raises(ConfigError, match="decode_buckets 16 exceed max_batch_size"):
        load_settings({"max_batch_size": "8"}, cfg)
    monkeypatch.setenv("CONVSERVE_DECODE_BUCKETS", "4,32")
    with pytest.raises(ConfigError, match="decode_buckets 32 exceed max_batch_size"):
        load_settings({"max_batch_size": "8"})


@pytest.mark.parametrize("most, buckets", [
    (100, [1, 2, 4, 8, 16, 32, 64, 100]),        # max_batch_size itself is the largest bucket
    (128, [1, 2, 4, 8, 16, 32, 64, 128]),
    (3, [1, 2, 3]),
    (1, [1]),
    (256, list(DEFAULTS.decode_buckets)),
    (1000, list(DEFAULTS.decode_buckets)),       # none above: as they are
])
def test_default_decode_buckets_stop_at_max_batch_size(most, buckets):
    s = load_settings({"max_batch_size": str(most)})
    assert s.decode_buckets == buckets
    assert s.max_decode_rows() == min(most, DEFAULTS.decode_buckets[-1])   # a full step's decodes: one launch
    assert EngineConfig.from_settings(s).decode_buckets == tuple(buckets)  # what the engine captures graphs for


def test_decode_buckets_given_within_max_batch_size_stay_as_given():
    s = load_settings({"decode_buckets": "8,1,2", "max_batch_size": "8"})
    assert s.decode_buckets == [1, 2, 8]
    assert load_settings({"decode_buckets": "1,2,4", "max_batch_size": "100"}).decode_buckets == [1, 2, 4]


def test_serve_refuses_buckets_above_max_batch_size_with_exit_2_and_prints_the_fitted_default(capsys):
    assert cli_main(["serve", "--print-config", "--decode-buckets", "1,2,64", "--max-batch-size", "32"]) == 2
    err = capsys.readouterr().err
    assert "decode_buckets 64 exceed max_batch_size (32)" in err and "decode_buckets 1,2,32" in err, err
    assert cli_main(["serve", "--print-config", "--max-batch-size", "48"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_buckets"] == [1, 2, 4, 8, 16, 32, 48]


# --- caller_step_max_tokens against max_batch_tokens

@pytest.mark.parametrize("given", [{"caller_step_max_tokens": "1024", "max_batch_tokens": "512"},
                                   {"caller_step_max_tokens": "9000"}],        # above the default max_batch_tokens
                         ids=["both-given", "caller-steps-given"])
def test_caller_step_max_tokens_above_max_batch_tokens_is_refused_naming_both_and_the_fix(given):
    with pytest.raises(ConfigError) as e:
        load_settings(given)
    msg = str(e.value)
    most = int(given.get("max_batch_tokens", DEFAULTS.max_batch_tokens))
    assert f"caller_step_max_tokens ({given['caller_step_max_tokens']}) exceeds max_batch_tokens ({most})" in msg
    assert "lower it, or raise max_batch_tokens" in msg


def test_caller_step_max_tokens_within_max_batch_tokens_or_unset_is_accepted(monkeypatch):
    assert load_settings({"caller_step_max_tokens": "512", "max_batch_tokens": "512"}).caller_step_max_tokens == 512
    assert load_settings({"caller_step_max_tokens": "0", "max_batch_tokens": "1"}).caller_step_max_tokens == 0
    # unset: the engine's default (512 on CUDA) is bounded by a smaller step as it stands, not refused
    assert load_settings({"max_batch_tokens": "256"}).caller_step_max_tokens is None
    monkeypatch.setenv("CONVSERVE_CALLER_STEP_MAX_TOKENS", "300")
    with pytest.raises(ConfigError, match=r"caller_step_max_tokens \(300\) exceeds max_batch_tokens \(256\)"):
        load_settings({"max_batch_tokens": "256"})


def test_serve_refuses_caller_step_max_tokens_above_max_batch_tokens_with_exit_2(capsys):
    assert cli_main(["serve", "--print-config", "--caller-step-max-tokens", "4096", "--max-batch-tokens", "2048"]) == 2
    assert "caller_step_max_tokens (4096) exceeds max_batch_tokens (2048)" in capsys.readouterr().err
