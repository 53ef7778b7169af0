"""TLS, mTLS and role tokens between the clients (the Python SDK and the
qstream-actor binary) and a real qstreamd on loopback. Certificates are
generated per module by tests/tls/make_test_certs.sh; nothing is committed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import build_dir, require_native

import qstream
from qstream import (
    ActorClient,
    AdminClient,
    AuthError,
    ConnectError,
    PolicyWatcher,
    StreamError,
    fetch_policy,
    open_channel,
    step_batch,
)
from qstream.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]

# CartPole-shaped; the learner never starts, so the replay holds exactly
# what was inserted.
IDLE_CONFIG = """
network { obs_dim: 4 trunk_hidden: 16 head_hidden: 8 num_atoms: 11 branch_actions: 2 }
replay { capacity: 200000 }
rate_limiter { min_size_to_sample: 200000 samples_per_insert: 1 }
returns { n_step: 3 gamma: 0.99 }
"""

TOKENS = {
    "actor": "actor-token-3f9d2c41b7e8a605",
    "observer": "observer-token-8c1e5a7d90b2f364",
    "admin": "admin-token-61b0e9c4d2a7f853",
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    out = tmp_path_factory.mktemp("tls")
    subprocess.run(["bash", str(REPO / "tests/tls/make_test_certs.sh"), str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> dict:
    """The daemon's token file (the admin token listed by digest) and one
    file per role holding that role's token, each ending in a newline."""
    out = tmp_path_factory.mktemp("tokens")
    admin_digest = hashlib.sha256(TOKENS["admin"].encode()).hexdigest()
    (out / "auth_tokens").write_text(
        f"actor {TOKENS['actor']}\nobserver {TOKENS['observer']}\nadmin sha256:{admin_digest}\n"
    )
    files = {"daemon": out / "auth_tokens"}
    for role, token in TOKENS.items():
        files[role] = out / f"{role}.token"
        files[role].write_text(token + "\n")
        files[role].chmod(0o600)
    return files


@pytest.fixture(params=["native", "aio"])
def transport(request, monkeypatch) -> str:
    """The Writer's transport under the ActorClient of a test: the gRPC C++
    one (libqstream_native) or grpc.aio ($QSTREAM_NATIVE_LIB empty)."""
    if request.param == "native":
        require_native()
    else:
        monkeypatch.setenv("QSTREAM_NATIVE_LIB", "")
    return request.param


def tls_flags(certs: Path, mtls: bool = False) -> list[str]:
    flags = [f"--tls_cert={certs / 'server.pem'}", f"--tls_key={certs / 'server.key'}"]
    if mtls:
        flags.append(f"--tls_client_ca={certs / 'ca.pem'}")
    return flags


def client_cert(certs: Path, name: str = "client") -> dict:
    return dict(tls_ca=certs / "ca.pem", tls_cert=certs / f"{name}.pem", tls_key=certs / f"{name}.key")


def steps(rng, n, env_id=0):
    obs = rng.normal(size=(n, 4))
    done = np.zeros(n, dtype=bool)
    done[-1] = True
    return dict(obs=obs, actions=rng.integers(0, 2, n), rewards=np.ones(n), next_obs=obs + 0.1, done=done,
                env_ids=np.full(n, env_id))


def stream_two_batches(server: str, **security) -> qstream.StreamStats:
    rng = np.random.default_rng(0)
    with ActorClient(server, batch_size=25, reconnect_timeout_s=3, **security) as client:
        for _ in range(2):
            client.add_steps(**steps(rng, 25))
        client.flush(timeout=30)
        return client.stats


# ---- channel parameters (no daemon) ----------------------------------------


def test_unusable_files_and_parameters_are_named(tmp_path, certs):
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.token is empty"):
        open_channel("127.0.0.1:1", token_file=empty)
    with pytest.raises(ValueError, match="missing.token: cannot read"):
        open_channel("127.0.0.1:1", token_file=tmp_path / "missing.token")
    with pytest.raises(ValueError, match="tls_ca .*nope.pem: cannot read"):
        open_channel("127.0.0.1:1", tls_ca=tmp_path / "nope.pem")
    with pytest.raises(ValueError, match="tls_ca .*empty.token holds no PEM block"):
        open_channel("127.0.0.1:1", tls_ca=empty)
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        open_channel("127.0.0.1:1", tls_ca=certs / "ca.pem", tls_cert=certs / "client.pem")
    with pytest.raises(ValueError, match="tls_server_name needs TLS"):
        open_channel("127.0.0.1:1", tls_server_name="localhost")
    with pytest.raises(ValueError, match="printable ASCII"):
        open_channel("127.0.0.1:1", token="two words")
    with pytest.raises(ValueError, match="not used with a ready channel"):
        PolicyWatcher(grpc.insecure_channel("127.0.0.1:1"), token="x" * 20)


# ---- TLS ---------------------------------------------------------------------


def test_tls_with_the_ca_streams_batches_and_gets_acks(start_daemon, certs, transport):
    d = start_daemon(IDLE_CONFIG, *tls_flags(certs))
    ca = certs / "ca.pem"
    stats = stream_two_batches(d.grpc, tls_ca=ca)
    assert stats.acked_batches == stats.sent_batches == 2
    assert stats.accepted_transitions == 50
    with PolicyWatcher(d.grpc, tls_ca=ca) as watcher:
        assert watcher.policy.arch.obs_dim == 4
    # The certificate names localhost too: checked under that name.
    assert fetch_policy(d.grpc, tls_ca=ca, tls_server_name="localhost").arch.branch_actions == (2,)
    st = d.status(tls_ca=ca)
    assert st.transitions_ingested == 50
    with AdminClient(d.grpc, tls_ca=ca) as admin:
        assert admin.health() == "SERVING"


def test_tls_daemon_refuses_plaintext_and_unknown_ca(start_daemon, certs):
    d = start_daemon(IDLE_CONFIG, *tls_flags(certs))
    with pytest.raises(ConnectError, match=f"could not reach qstreamd at {d.grpc} within 1s: UNAVAILABLE"):
        fetch_policy(d.grpc, timeout=1)
    # A CA that did not sign the server certificate: the handshake fails.
    with pytest.raises(ConnectError, match="within 1s: UNAVAILABLE") as e:
        fetch_policy(d.grpc, timeout=1, tls_ca=certs / "other-ca.pem")
    assert "handshake" in str(e.value).lower() or "certificate" in str(e.value).lower(), e.value
    # The name the certificate does not hold.
    with pytest.raises(ConnectError):
        fetch_policy(d.grpc, timeout=1, tls_ca=certs / "ca.pem", tls_server_name="daemon.example")


# ---- mTLS --------------------------------------------------------------------


def test_mtls_right_client_certificate_works(start_daemon, certs, transport):
    d = start_daemon(IDLE_CONFIG, *tls_flags(certs, mtls=True))
    stats = stream_two_batches(d.grpc, **client_cert(certs))
    assert stats.acked_batches == 2 and stats.accepted_transitions == 50
    assert fetch_policy(d.grpc, **client_cert(certs)).version >= 0
    assert d.status(**client_cert(certs)).transitions_ingested == 50


@pytest.mark.parametrize("cert", ["other-client", None])
def test_mtls_other_ca_or_no_client_certificate_fails_clearly(start_daemon, certs, cert, transport):
    d = start_daemon(IDLE_CONFIG, *tls_flags(certs, mtls=True))
    security = client_cert(certs, cert) if cert else dict(tls_ca=certs / "ca.pem")
    with pytest.raises(ConnectError, match=f"could not reach qstreamd at {d.grpc} within 1s: UNAVAILABLE") as e:
        fetch_policy(d.grpc, timeout=1, **security)
    assert "tls_cert/tls_key for a daemon that requires client certificates" in str(e.value)
    with pytest.raises(StreamError, match="could not reconnect within 2s .*UNAVAILABLE"):
        with ActorClient(d.grpc, reconnect_timeout_s=2, **security) as client:
            client.send(step_batch(**steps(np.random.default_rng(1), 5)))
            client.flush(timeout=30)
    assert d.status(**client_cert(certs)).transitions_ingested == 0


# ---- tokens ------------------------------------------------------------------


def test_actor_token_streams_and_observer_reads_status(start_daemon, tokens, transport):
    d = start_daemon(IDLE_CONFIG, f"--auth_tokens={tokens['daemon']}")
    stats = stream_two_batches(d.grpc, token_file=tokens["actor"])
    assert stats.accepted_transitions == 50
    with PolicyWatcher(d.grpc, token=TOKENS["actor"]) as watcher:
        assert watcher.policy.arch.obs_dim == 4
    observed = d.status(token_file=tokens["observer"])
    assert observed.transitions_ingested == 50
    assert observed.config_redacted and not observed.HasField("config")
    full = d.status(token_file=tokens["admin"])  # listed by its sha256 digest
    assert not full.config_redacted and full.config.network.obs_dim == 4


def test_missing_or_unknown_token_is_unauthenticated(start_daemon, tokens, transport):
    d = start_daemon(IDLE_CONFIG, f"--auth_tokens={tokens['daemon']}")
    for security in ({}, {"token": "not-a-known-token-0000"}):
        with pytest.raises(AuthError) as e:
            stream_two_batches(d.grpc, **security)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "ExperienceService.Stream: the daemon refused the token (UNAUTHENTICATED" in str(e.value)
        assert e.value.details  # the daemon's own message
        start = time.monotonic()
        with pytest.raises(AuthError) as e:
            fetch_policy(d.grpc, timeout=30, **security)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - start < 5  # refused at once, not retried until the timeout
        with pytest.raises(AuthError, match="AdminService.Status"):
            d.status(**security)
    assert d.status(token_file=tokens["admin"]).transitions_ingested == 0


def test_observer_token_on_experience_service_is_permission_denied(start_daemon, tokens, transport):
    d = start_daemon(IDLE_CONFIG, f"--auth_tokens={tokens['daemon']}")
    with pytest.raises(AuthError) as e:
        stream_two_batches(d.grpc, token_file=tokens["observer"])
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "refused the token (PERMISSION_DENIED, wrong role)" in str(e.value)
    with pytest.raises(AuthError) as e:
        fetch_policy(d.grpc, token_file=tokens["observer"])
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    # Pausing the learner is the admin's alone.
    with AdminClient(d.grpc, token_file=tokens["actor"]) as admin, pytest.raises(AuthError) as e:
        admin.pause()
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with AdminClient(d.grpc, token_file=tokens["admin"]) as admin:
        admin.pause()
        assert admin.status().paused
        admin.resume()


# ---- everything at once: the Python CLI and the C++ actor --------------------


def test_python_cli_over_mtls_with_token(start_daemon, certs, tokens, capsys):
    d = start_daemon(IDLE_CONFIG, *tls_flags(certs, mtls=True), f"--auth_tokens={tokens['daemon']}")
    security = [f"--tls_ca={certs / 'ca.pem'}", f"--tls_cert={certs / 'client.pem'}",
                f"--tls_key={certs / 'client.key'}", "--tls_server_name=localhost"]
    args = ["--server", d.grpc, "--env", "CartPole-v1", "--num_envs", "2", "--steps", "400", "--batch_size", "100"]
    assert cli_main([*args, *security, f"--token_file={tokens['actor']}"]) == 0
    assert d.status(**client_cert(certs), token_file=tokens["admin"]).transitions_ingested >= 400 - 2 * 2
    assert cli_main([*args, *security, f"--token_file={tokens['observer']}"]) == 1
    assert "refused the token (PERMISSION_DENIED" in capsys.readouterr().err


def actor_binary() -> Path:
    path = build_dir() / "qstream-actor"
    if not path.is_file():
        pytest.skip(f"{path} not built")
    return path


def run_actor_binary(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(actor_binary()), *args], capture_output=True, text=True, timeout=timeout)


def test_cpp_actor_over_mtls_with_token(start_daemon, certs, tokens):
    d = start_daemon(IDLE_CONFIG, *tls_flags(certs, mtls=True), f"--auth_tokens={tokens['daemon']}")
    security = [f"--tls_ca={certs / 'ca.pem'}", f"--tls_cert={certs / 'client.pem'}",
                f"--tls_key={certs / 'client.key'}"]
    common = [f"--server={d.grpc}", "--num_envs=2", "--report_every_s=60"]

    r = run_actor_binary(*common, *security, "--tls_server_name=localhost", f"--token_file={tokens['actor']}",
                         "--steps=2000", "--stream_id=tls-actor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "qstream-actor finished env_steps=2000" in r.stdout
    # The clean half-close flushed every n-step window.
    assert d.status(**client_cert(certs), token_file=tokens["admin"]).transitions_ingested == 2000

    # Refused tokens end the actor at once, saying so (no retry loop).
    for token_file, expected in [
        (tokens["observer"], "GetPolicy: the daemon refused the token (PERMISSION_DENIED"),
        (None, "GetPolicy: the daemon refused the token (UNAUTHENTICATED"),
    ]:
        flags = [f"--token_file={token_file}"] if token_file else []
        start = time.monotonic()
        r = run_actor_binary(*common, *security, *flags, "--steps=100", "--connect_timeout_s=30")
        assert r.returncode == 1, r.stdout + r.stderr
        assert expected in r.stderr, r.stderr
        assert time.monotonic() - start < 10

    # Without a client certificate the handshake fails: retried, then reported.
    r = run_actor_binary(*common, f"--tls_ca={certs / 'ca.pem'}", f"--token_file={tokens['actor']}",
                         "--steps=100", "--connect_timeout_s=1")
    assert r.returncode == 1, r.stderr
    # gRPC's own words differ by load-balancing policy ("failed to connect",
    # "connections to all backends failing"); the actor's hint does not.
    assert "GetPolicy failed for 1s: " in r.stderr and "--tls_cert/--tls_key" in r.stderr, r.stderr


def test_cpp_actor_names_unusable_files(tmp_path, certs):
    empty = tmp_path / "empty.token"
    empty.write_text("")
    for flags, expected in [
        ([f"--token_file={empty}"], f"--token_file: {empty} is empty"),
        ([f"--token_file={tmp_path / 'missing'}"], f"--token_file: cannot read {tmp_path / 'missing'}"),
        ([f"--tls_ca={tmp_path / 'missing.pem'}"], f"--tls_ca: cannot read {tmp_path / 'missing.pem'}"),
        ([f"--tls_ca={certs / 'ca.pem'}", f"--tls_cert={certs / 'client.pem'}"], "--tls_cert and --tls_key go together"),
    ]:
        r = run_actor_binary("--server=127.0.0.1:1", *flags, timeout=10)
        assert r.returncode == 1 and expected in r.stderr, (flags, r.stderr)
