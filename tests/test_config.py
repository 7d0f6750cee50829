"""Settings: defaults, flags > environment > config file, start-up validation with clear messages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from convserve.service.cli import main as cli_main
from convserve.service.config import ConfigError, Settings, load_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CONVSERVE_"):
            monkeypatch.delenv(k)


def test_defaults_serve_the_embedded_model_on_localhost_8000():
    s = load_settings()
    assert (s.host, s.port, s.device, s.weights) == ("127.0.0.1", 8000, "auto", None)
    assert (s.layers, s.dim, s.width, s.seed) == (4, 1024, 4, 0)
    assert s.api_key is None


def _value(s, name):
    v = getattr(s, name)
    return v.get_secret_value() if name == "api_key" else v


@pytest.mark.parametrize("name, flag, env, file, from_flag, from_env, from_file", [
    ("port", "9001", "9002", "9003", 9001, 9002, 9003),
    ("dim", "64", "128", "256", 64, 128, 256),
    ("layers", "0,2,5", "3", "1,4", [0, 2, 5], 3, [1, 4]),
    ("slots", "auto", "7", "9", "auto", 7, 9),
    ("decode_buckets", "8,1,2", "4", "16", [1, 2, 8], [4], [16]),
    ("api_key", "s3cret", "other", "filekey", "s3cret", "other", "filekey"),
])
def test_flags_override_env_which_overrides_the_file(tmp_path, monkeypatch, name, flag, env, file, from_flag,
                                                     from_env, from_file):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'{name} = "{file}"\nwidth = 3\n')
    assert _value(load_settings({}, cfg), name) == from_file
    monkeypatch.setenv("CONVSERVE_" + name.upper(), env)
    assert _value(load_settings({}, cfg), name) == from_env
    s = load_settings({name: flag}, cfg)
    assert _value(s, name) == from_flag
    assert s.width == 3  # untouched keys still come from the file


def test_env_values_are_parsed_like_flags(monkeypatch):
    monkeypatch.setenv("CONVSERVE_LAYERS", "[1, 3]")
    monkeypatch.setenv("CONVSERVE_CHECK_FINITE", "false")
    monkeypatch.setenv("CONVSERVE_STATE_DTYPE", "float32")
    s = load_settings()
    assert s.layers == [1, 3] and s.check_finite is False and s.state_dtype == "float32"


def test_config_file_may_be_json_and_named_by_env(tmp_path, monkeypatch):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"max-body-bytes": 4096, "port": 1234}))
    monkeypatch.setenv("CONVSERVE_CONFIG", str(cfg))
    s = load_settings()
    assert s.max_body_bytes == 4096 and s.port == 1234


def test_max_tokens_per_request_left_unset_follows_a_smaller_max_batch_tokens():
    assert load_settings({"max_batch_tokens": "4096"}).max_tokens_per_request == 4096
    assert load_settings({"max_batch_tokens": "16384"}).max_tokens_per_request == 8192
    assert load_settings({"max_batch_tokens": "4096", "max_tokens_per_request": "100"}).max_tokens_per_request == 100


@pytest.mark.parametrize("overrides, fragment", [
    ({"port": "70000"}, "--port / CONVSERVE_PORT"),
    ({"device": "tpu"}, "not one of auto, cpu, cuda"),
    ({"layers": "0,0"}, "duplicate layer index"),
    ({"layers": "0"}, "count must be >= 1"),
    ({"slots": "many"}, "neither an integer nor 'auto'"),
    ({"width": "9"}, "--width"),
    ({"decode_buckets": "0,2"}, "positive batch sizes"),
    ({"weights": "/nonexistent.safetensors"}, "is neither a file nor a directory"),
    ({"dtype": "int8"}, "--dtype"),
    ({"max_tokens_per_request": "9000", "max_batch_tokens": "8192"}, "could never be scheduled"),
    ({"max_body_objects": "100", "max_batch_size": "32"}, "raise max_body_objects to 192 or more"),
    ({"nope": 1}, "nope"),
    ({"engine_reply_timeout_s": "30", "request_timeout_s": "30"}, "must exceed request_timeout_s"),
    ({"engine_reply_timeout_s": "0"}, "--engine-reply-timeout-s"),
    ({"engine_busy_poll_us": "soon"}, "--engine-busy-poll-us / CONVSERVE_ENGINE_BUSY_POLL_US"),
    ({"engine_busy_poll_us": "-1"}, "outside 0..1000000"),
    ({"engine_busy_poll_us": "1000001"}, "outside 0..1000000"),
    ({"shutdown_timeout_s": "inf"}, "--shutdown-timeout-s / CONVSERVE_SHUTDOWN_TIMEOUT_S: Input should be a finite"),
    ({"snapshot_timeout_s": "1e400"}, "--snapshot-timeout-s"),          # overflows to inf
    ({"request_timeout_s": "infinity"}, "--request-timeout-s"),
    ({"engine_reply_timeout_s": "inf"}, "--engine-reply-timeout-s"),
    ({"engine_down_unhealthy_s": "nan"}, "--engine-down-unhealthy-s"),
    ({"shutdown_timeout_s": "1e9"}, "less than or equal to 86400"),   # poll() takes a C int of milliseconds
    ({"snapshot_interval_s": "86401"}, "--snapshot-interval-s"),
    ({"api_key": ""}, "the key is empty"),
    ({"api_key": "  "}, "the key is empty"),
    ({"replica_name": ""}, "--replica-name"),
    ({"seed": str(2**63)}, "--seed / CONVSERVE_SEED"),                  # torch's generator takes 64-bit seeds
    ({"seed": "-1"}, "--seed"),
])
def test_invalid_settings_fail_with_the_setting_named(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_settings(overrides)
    assert fragment in str(e.value)


@pytest.mark.parametrize("random_only", [{"dim": "100"}, {"width": "3"}, {"layers": "2"}, {"seed": "5"},
                                         {"layers": "0,2", "dim": "64"}])
@pytest.mark.parametrize("how", ["flags", "env", "file"])
def test_random_model_settings_beside_weights_are_refused_not_ignored(tmp_path, monkeypatch, random_only, how):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")                     # (read by the engine, not here)
    if how == "flags":
        given = {"weights": str(weights), **random_only}
    elif how == "env":
        for k, v in random_only.items():
            monkeypatch.setenv(f"CONVSERVE_{k.upper()}", v)
        given = {"weights": str(weights)}
    else:
        cfg = tmp_path / "c.toml"
        cfg.write_text("".join(f'{k} = {v if v.isdigit() else repr(v)}\n' for k, v in random_only.items()))
        given = {"weights": str(weights)}
    with pytest.raises(ConfigError) as e:
        load_settings(given, config_file=cfg if how == "file" else None)
    for k in random_only:
        assert f"--{k}" in str(e.value)
    assert "the random model, and weights is set" in str(e.value)


def test_weights_take_a_directory_and_a_cast(tmp_path):
    s = load_settings({"weights": str(tmp_path), "dtype": "float32"})
    assert s.weights == tmp_path and s.dtype == "float32"


def test_config_file_with_unknown_key_is_rejected(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("prot = 80\n")
    with pytest.raises(ConfigError, match="unknown settings \\['prot'\\]"):
        load_settings({}, cfg)


def test_every_setting_is_a_flag_and_an_env_var(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in out
        assert "CONVSERVE_" + name.upper() in out.replace("\n", "").replace(" ", "")
    # a list's default as the flag takes it
    assert "CONVSERVE_DECODE_BUCKETS;default1,2,4,8,16,32,64,128,256]" in out.replace("\n", "").replace(" ", "")


def test_the_help_texts_are_plain_text_not_docstring_markup(capsys):
    from convserve.clients.loadtest.arguments import build_parser
    from convserve.clients.loadtest.cli import __doc__ as loadtest_doc

    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    for out in (capsys.readouterr().out, build_parser(loadtest_doc).format_help()):
        assert "``" not in out and ":class:" not in out and ":func:" not in out, out[:400]


def test_cli_exits_2_with_a_message_on_bad_config():
    r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--port", "x"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "--port / CONVSERVE_PORT" in r.stderr


def test_print_config_hides_the_api_key(capsys):
    assert cli_main(["serve", "--print-config", "--api-key", "hunter2", "--dim", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["api_key"] == "***" and out["dim"] == 32
    # what the auto and unset values resolve to here
    assert out["workers"] == "auto" and out["derived"]["workers"] >= 1
    assert out["derived"]["devices"] == ["cpu"]
    assert out["derived"]["engine_reply_timeout_s"] == out["request_timeout_s"] + 60


def test_serve_sets_the_gil_switch_interval_before_building_the_engine(monkeypatch):
    from convserve.service import cli

    def no_model(settings):
        raise ConfigError("stop here")

    before = sys.getswitchinterval()
    monkeypatch.setattr(cli, "build_engine", no_model)
    try:
        assert cli.serve(Settings(gil_switch_interval_us=700, workers=0)) == cli.EXIT_CONFIG
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)
    assert Settings().gil_switch_interval_us == 500


def test_the_api_key_comes_from_a_file_and_never_shows_in_a_config_error(tmp_path):
    f = tmp_path / "key"
    f.write_text("  fromfile-secret\n")
    assert load_settings({"api_key_file": str(f)}).api_key_value() == "fromfile-secret"
    with pytest.raises(ConfigError, match="both set"):
        load_settings({"api_key_file": str(f), "api_key": "other"})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        load_settings({"api_key_file": str(tmp_path / "empty")})
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"api_key": ["hunter2-in-a-list"], "port": "not-a-port"}))
    with pytest.raises(ConfigError) as e:
        load_settings({}, cfg)
    msg = str(e.value)
    assert "--api-key" in msg and "hunter2" not in msg
    assert "not-a-port" in msg                # other fields still show what came


@pytest.mark.parametrize("key", ["h\u00e9llo", "bell\u0007in", "esc\u001bin", "\u5bc6\u94a5", "del\u007fin"])
@pytest.mark.parametrize("given", ["flag", "env", "file"])
def test_an_api_key_a_header_cannot_carry_is_refused_at_start_without_showing_it(tmp_path, monkeypatch, key, given):
    """The key is sent as ``Authorization: Bearer <key>``: a key outside visible ASCII would start a server that
    its own client (and most HTTP clients) cannot authenticate to."""
    f = tmp_path / "key"
    f.write_text(key + "\n", encoding="utf-8")
    if given == "env":
        monkeypatch.setenv("CONVSERVE_API_KEY", key)
    overrides = {"flag": {"api_key": key}, "env": {}, "file": {"api_key_file": str(f)}}[given]
    with pytest.raises(ConfigError, match="visible ASCII") as e:
        load_settings(overrides)
    assert key not in str(e.value) and key[:3] not in str(e.value)


@pytest.mark.parametrize("key", ["two words", "tab\tin", "~!@#$%^&*()", "k"])
def test_an_api_key_of_header_characters_is_taken_inner_spaces_too(key):
    assert load_settings({"api_key": key}).api_key_value() == key


def test_several_devices_with_workers_0_are_refused_not_left_unused(monkeypatch):
    s = load_settings({"devices": "cpu,cpu", "workers": "0"})
    with pytest.raises(ConfigError, match="--workers 0 runs one engine"):
        s.resolved_devices()
    from convserve.service import config

    monkeypatch.setattr(config, "_cuda_count", lambda: 2)     # 'all' on a node of two GPUs
    with pytest.raises(ConfigError, match="--workers 0 runs one engine"):
        load_settings({"devices": "all", "workers": "0"}).resolved_devices()
    assert load_settings({"devices": "all", "workers": "1"}).resolved_devices() == ["cuda:0", "cuda:1"]
    assert load_settings({"devices": "cuda:1", "workers": "0"}).resolved_devices() == ["cuda:1"]
    monkeypatch.setattr(config, "_cuda_count", lambda: 1)
    assert load_settings({"devices": "all", "workers": "0"}).resolved_devices() == ["cuda:0"]
    assert load_settings({"devices": "cpu", "workers": "0"}).resolved_devices() == ["cpu"]
    assert load_settings({"devices": "cpu,cpu", "workers": "1"}).resolved_devices() == ["cpu", "cpu"]
    r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--devices", "cpu,cpu", "--workers", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--workers 0 runs one engine" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("buckets, batch, rows", [("1,2,4", 256, 4), ("1,2,256", 256, 256), ("8,64", 64, 64),
                                                  (None, 3, 3), (None, 100, 100), (None, 512, 256)])
def test_max_decode_rows_is_the_largest_bucket_a_batch_can_fill(buckets, batch, rows):
    given = {"max_batch_size": str(batch)} | ({"decode_buckets": buckets} if buckets else {})
    assert load_settings(given).max_decode_rows() == rows


def test_a_bad_workers_value_names_the_flag_and_what_it_accepts():
    # workers is an int or 'auto': the error must name --workers / CONVSERVE_WORKERS, as every other setting's
    # does, not pydantic's union branches ("workers.int", "workers.literal['auto']")
    with pytest.raises(ConfigError) as e:
        load_settings({"workers": "many"})
    msg = str(e.value)
    assert "--workers / CONVSERVE_WORKERS" in msg and "neither an integer nor 'auto'" in msg
    assert "literal" not in msg
    assert load_settings({"workers": "3"}).workers == 3 and load_settings({"workers": "AUTO"}).workers == "auto"


@pytest.mark.parametrize("keep,want", [(16 << 20, [(-3, 8 << 20), (-1, 16 << 20)]), (0, [(-3, 1 << 20)]),
                                       (1 << 30, [(-3, 32 << 20), (-1, 1 << 30)]), (1 << 20, [(-3, 1 << 20),
                                                                                              (-1, 1 << 20)])])
def test_heap_keep_bytes_sets_glibcs_mmap_and_trim_thresholds(monkeypatch, keep, want):
    import ctypes

    from convserve.service import cli

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    cli.tune_malloc(keep)
    assert calls == want


@pytest.mark.parametrize("var", ["CONVSERVE_MAX_BODY_BYTE", "CONVSERVE_WORKERZ", "CONVSERVE_"])
def test_an_unknown_convserve_variable_is_an_error_naming_it(monkeypatch, var):
    monkeypatch.setenv(var, "5")
    with pytest.raises(ConfigError, match=var + r"\b"):
        load_settings()


def test_the_config_path_and_the_clients_url_are_not_taken_for_settings(monkeypatch, tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"port": 9001}')
    monkeypatch.setenv("CONVSERVE_CONFIG", str(path))
    monkeypatch.setenv("CONVSERVE_URL", "http://127.0.0.1:9001")
    assert load_settings().port == 9001


def test_a_snapshot_interval_without_a_state_dir_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="state_dir"):
        load_settings({"snapshot_interval_s": 5})
    assert load_settings({"snapshot_interval_s": 5, "state_dir": tmp_path}).snapshot_interval_s == 5


def test_a_bad_value_from_the_config_file_names_the_file_and_a_bad_suffix_is_said_once(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('heap_keep_bytes = "16MiB"\n')
    with pytest.raises(ConfigError, match=r"--heap-keep-bytes / CONVSERVE_HEAP_KEEP_BYTES \(in config file "):
        load_settings(config_file=path)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("port: 1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(config_file=yaml)
    assert str(err.value).count("config file") == 1 and "use a .toml or .json file" in str(err.value)


@pytest.mark.parametrize("cores,workers,engines,given,want", [
    (16, "auto", 1, "auto", 2000),     # 8 workers + 1 engine + 1 polling core <= 16
    (8, "3", 1, "auto", 2000),         # the H200 bench's server: 8 cores, 3 workers
    (8, "auto", 1, "auto", 0),         # auto workers take 7 cores: none left to poll on
    (2, "auto", 1, "auto", 0),         # a small box: the core is better spent on the worker
    (16, "9", 4, "auto", 0),           # 9 + 2 x 4 > 16
    (16, "4", 4, "auto", 2000),
    (2, "1", 1, "300", 300),           # given: taken as given
    (64, "auto", 1, "0", 0),
])
def test_engine_busy_poll_auto_polls_only_where_a_core_is_left_for_it(monkeypatch, cores, workers, engines, given,
                                                                        want):
    from convserve.service import config

    monkeypatch.setattr(config, "_usable_cores", lambda: cores)
    s = load_settings({"workers": workers, "engine_busy_poll_us": given})
    assert s.resolved_busy_poll_us(engines) == want


@pytest.mark.parametrize("flags", [["--devices", "cuda:0"], ["--device", "cuda"]])
def test_print_config_asking_for_cuda_on_a_machine_without_it_is_the_config_error_not_a_traceback(monkeypatch, capsys,
                                                                                                  flags):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli_main(["serve", "--print-config", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convserve: ") and "CUDA" in err and "Traceback" not in err


# what Kubernetes injects into every pod of a namespace with a Service named convserve (docker/k8s/services.yaml)
SERVICE_LINKS = {"CONVSERVE_SERVICE_HOST": "10.96.0.12", "CONVSERVE_SERVICE_PORT": "8000",
                 "CONVSERVE_SERVICE_PORT_HTTP": "8000", "CONVSERVE_PORT": "tcp://10.96.0.12:8000",
                 "CONVSERVE_PORT_8000_TCP": "tcp://10.96.0.12:8000", "CONVSERVE_PORT_8000_TCP_PROTO": "tcp",
                 "CONVSERVE_PORT_8000_TCP_PORT": "8000", "CONVSERVE_PORT_8000_TCP_ADDR": "10.96.0.12"}


# the same for a Service named convserve-proxy in the namespace
OTHER_SERVICE_LINKS = {"CONVSERVE_PROXY_SERVICE_HOST": "10.96.0.13", "CONVSERVE_PROXY_SERVICE_PORT": "8080",
                       "CONVSERVE_PROXY_PORT": "tcp://10.96.0.13:8080", "CONVSERVE_PROXY_PORT_8080_TCP_ADDR": "10.96.0.13",
                       "CONVSERVE_PROXY_PORT_8080_TCP": "tcp://10.96.0.13:8080"}


@pytest.mark.parametrize("port_flag", [None, 9123])
def test_kubernetes_service_links_are_ignored_not_settings(monkeypatch, port_flag):
    for k, v in {**SERVICE_LINKS, **OTHER_SERVICE_LINKS}.items():
        monkeypatch.setenv(k, v)
    s = load_settings({"port": port_flag} if port_flag else None)
    assert s.port == (port_flag or 8000)


def test_a_numeric_convserve_port_is_still_the_port_beside_service_links(monkeypatch):
    for k, v in SERVICE_LINKS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CONVSERVE_PORT", "9001")
    assert load_settings().port == 9001


@pytest.mark.parametrize("name", ["CONVSERVE_SERVICE_HOSTNAME", "CONVSERVE_PORT_8000", "CONVSERVE_PORT_X_TCP",
                                  "CONVSERVE_PROT"])
def test_near_misses_of_service_links_are_still_unknown_variables(monkeypatch, name):
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError, match=name):
        load_settings()


def test_serve_starts_its_config_with_service_links_in_a_real_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env.update(SERVICE_LINKS)
    r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--print-config", "--device", "cpu"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["port"] == 8000


@pytest.mark.parametrize("given,want", [("DEBUG", "debug"), ("Info", "info"), ("warning", "warning")])
def test_the_log_level_is_taken_in_any_case(given, want):
    assert load_settings({"log_level": given}).log_level == want


def test_an_unreadable_api_key_file_names_the_flag_and_the_variable(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_settings({"api_key_file": str(tmp_path / "missing")})
    line = str(e.value).splitlines()[-1].strip()
    assert line.startswith("--api-key-file / CONVSERVE_API_KEY_FILE: cannot read") and "settings:" not in line


def test_engine_busy_poll_is_zero_without_engine_processes(monkeypatch):
    from convserve.service import config

    monkeypatch.setattr(config, "_usable_cores", lambda: 64)
    assert load_settings({"workers": "0", "engine_busy_poll_us": "auto"}).resolved_busy_poll_us(1) == 0


def test_convserve_on_a_client_only_install_names_the_missing_modules_and_the_extra_to_install(monkeypatch, capsys):
    from convserve.service import cli

    assert cli.missing_server_modules() == []          # this (test) install has the server's dependencies
    monkeypatch.setattr(cli, "SERVER_MODULES", ("pydantic", "convserve_no_such_module", "no_such_pkg.sub"))
    assert cli.missing_server_modules() == ["convserve_no_such_module", "no_such_pkg.sub"]
    assert cli.main(["serve", "--help"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "'convserve_no_such_module'" in err and "pip install 'convserve[server]'" in err
    assert "Traceback" not in err


def test_an_empty_api_key_from_the_environment_is_refused_not_taken_as_no_key(monkeypatch):
    # `-e CONVSERVE_API_KEY="$KEY"` with KEY unset would otherwise serve every route to anyone
    monkeypatch.setenv("CONVSERVE_API_KEY", "")
    with pytest.raises(ConfigError, match="the key is empty"):
        load_settings({})


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a directory: give the file's path"):
        load_settings({}, tmp_path)


@pytest.mark.parametrize("overrides, fragment", [
    ({"max_spec_tokens": "100000"}, "no verify that long can be sent"),
    ({"max_spec_tokens": "65", "max_tokens_per_request": "64"}, "max_spec_tokens (65) exceeds"),
    ({"max_json_body_bytes": str(3 << 20), "max_body_bytes": str(2 << 20)}, "which bounds every body"),
    ({"max_prefill_tokens_per_step": "8193"}, "the tokens of one step"),
])
def test_a_limit_given_above_the_limit_that_bounds_it_is_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_settings(overrides)


def test_the_bounded_limits_defaults_stay_valid_under_small_bounds():
    s = load_settings({"max_tokens_per_request": "8", "max_body_bytes": "4096", "max_batch_tokens": "16"})
    assert s.max_json_body_bytes == 2 << 20          # its default: bounded where it acts
    assert s.max_spec_tokens == 8                    # its default follows: /v1/model never offers a verify refused


@pytest.mark.parametrize("given, spec", [({}, 16), ({"max_batch_tokens": "12"}, 12),
                                         ({"max_tokens_per_request": "1"}, 1),
                                         ({"max_tokens_per_request": "8", "max_spec_tokens": "4"}, 4)])
def test_max_spec_tokens_by_default_follows_max_tokens_per_request_down(given, spec):
    assert load_settings(given).max_spec_tokens == spec


@pytest.mark.parametrize("key, value", [("max_queue", True), ("request_clients_kept", False), ("session_ttl_s", True),
                                        ("decode_buckets", [True, 2]),
                                        ("verify_ids_kept", 1025), ("request_clients_kept", 0),
                                        ("max_evicted_ids", 1 << 23)])
def test_a_config_file_number_that_is_a_boolean_or_out_of_bounds_is_refused(tmp_path, key, value):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({key: value}))
    with pytest.raises(ConfigError, match="CONVSERVE_" + key.upper()):
        load_settings({}, cfg)


def test_a_boolean_setting_still_takes_a_boolean(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"check_finite": False, "access_log": True}))
    s = load_settings({}, cfg)
    assert s.check_finite is False and s.access_log is True


@pytest.mark.parametrize("key, value", [("slots", 1.5), ("workers", 2.5), ("slots", [1]),
                                        ("max_prefill_tokens_per_step", 2.5), ("engine_busy_poll_us", {"a": 1})])
def test_a_config_file_value_of_an_integer_or_auto_setting_that_is_neither_names_the_setting(tmp_path, key, value):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({key: value}))
    with pytest.raises(ConfigError) as e:
        load_settings({}, cfg)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 1, lines                  # one line, not one per branch of the int | 'auto' union
    assert "--" + key.replace("_", "-") + " / CONVSERVE_" + key.upper() in lines[0], lines
    assert "neither an integer nor 'auto'" in lines[0] and str(cfg) in lines[0], lines
