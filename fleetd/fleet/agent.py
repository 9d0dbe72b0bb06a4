"""The node side of fleetctl deploy: a stdlib-only script sent over SSH to `python3 -`.

    python3 - OP JSON_PARAMS   ->   one JSON object on stdout

It must run on a node where nothing of fleetd is installed yet, so it imports only the standard
library and nothing from this package. Layout under ROOT (/opt/fleetd for root, else
~/.local/share/fleetd):

    wheels/              uploaded wheels (the node needs no package index)
    releases/<release>/  one venv per release (<version>-<wheel sha>)
    current -> releases/<release>
    fleetd.toml          the node's configuration
    fleetd.pid           "<pid> <release>" of the supervisor, when not under systemd
    fleetd.log
    cache/               fleetd's cache directory (SET_TENSOR_HASH), the one place it writes
    .service-user        the service user's name, when this agent created that user

As root, fleetd runs as a service user (fleetd by default): a system account without a home or a
login shell, created here when missing, which owns cache/ and nothing else. Under systemd the
unit's User= and sandboxing do that; without systemd the supervisor starts fleetd as root and
fleetd drops to the user (its config's `user`) once its port is bound.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

UNIT = "fleetd.service"


def _root(p):
    return os.path.expanduser(p["root"])


def _read_pidfile(root):
    try:
        pid, release = open(os.path.join(root, "fleetd.pid")).read().split()
        pid = int(pid)
    except (OSError, ValueError):
        return None
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return None
    return {"pid": pid, "release": release} if "fleetd" in cmdline else None


def _use_systemd(p):
    if not p.get("systemd", True) or not os.path.isdir("/run/systemd/system"):
        return False
    args = ["systemctl"] + ([] if os.geteuid() == 0 else ["--user"]) + ["is-system-running"]
    try:
        state = subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return state in ("running", "degraded")


def _systemctl(*args):
    base = ["systemctl"] + ([] if os.geteuid() == 0 else ["--user"])
    return subprocess.run(base + list(args), capture_output=True, text=True, timeout=60)


def _port_state(host, port, ours):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        return "free"
    except OSError:
        return "ours" if ours else "busy"
    finally:
        s.close()


def op_inspect(p):
    """What deploy's check step decides on: interpreter, free disk, releases, what runs and the
    RPC port's state, the config and unit in place, the uploaded wheels."""
    root = _root(p)
    unit = _unit_path()
    current = os.path.join(root, "current")
    release = os.path.basename(os.readlink(current)) if os.path.islink(current) else None
    running = _read_pidfile(root)
    systemd = _use_systemd(p)
    if systemd and running is None and _systemctl("is-active", UNIT).stdout.strip() == "active":
        running = {"pid": 0, "release": release}
    try:
        config = open(os.path.join(root, "fleetd.toml")).read()
    except OSError:
        config = None
    probe = root
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return {
        "python": "%d.%d" % sys.version_info[:2],
        "free_bytes": st.f_bavail * st.f_frsize,
        "current": release,
        "releases": sorted(os.listdir(os.path.join(root, "releases")))
        if os.path.isdir(os.path.join(root, "releases"))
        else [],
        "running": running,
        "port": _port_state(p.get("host", "0.0.0.0"), p["port"], running is not None),
        "config": config,
        "systemd": systemd,
        "wheels": _wheels(os.path.join(root, "wheels")),
        "root": root,
        "euid": os.geteuid(),
        "unit": open(unit).read() if systemd and os.path.exists(unit) else None,
    }


def _wheels(top):
    """Wheel paths relative to wheels/: dependencies at the top, fleetd's under its release."""
    out = []
    for dirpath, _dirs, files in os.walk(top):
        rel = os.path.relpath(dirpath, top)
        out += [f if rel == "." else f"{rel}/{f}" for f in files if f.endswith(".whl")]
    return sorted(out)


def op_prepare(p):
    root = _root(p)
    for d in ("releases", os.path.join("wheels", p["release"])):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    return {"root": root}


def op_install(p):
    """A venv for the release from the uploaded wheels only (--no-index)."""
    root = _root(p)
    venv = os.path.join(root, "releases", p["release"])
    wheels = os.path.join(root, "wheels")
    marker = os.path.join(venv, ".installed")
    if os.path.exists(marker):
        return {"installed": False}
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True, capture_output=True)
    pip = [
        os.path.join(venv, "bin", "python"),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--find-links",
        wheels,
        "--disable-pip-version-check",
    ]
    for args in (p["requirements"], ["--no-deps", os.path.join(wheels, p["release"], p["wheel"])]):
        r = subprocess.run(pip + args, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("pip install: " + (r.stderr.strip().splitlines() or ["failed"])[-1])
    open(marker, "w").close()
    return {"installed": True}


def op_configure(p):
    """Write fleetd.toml when it differs (None removes it: a roll-back to no config); says whether
    it changed."""
    root = _root(p)
    path = os.path.join(root, "fleetd.toml")
    if p["config"] is None:  # back to no configuration (a roll-back on a fresh node)
        existed = os.path.exists(path)
        if existed:
            os.unlink(path)
        return {"changed": existed}
    try:
        if open(path).read() == p["config"]:
            return {"changed": False}
    except OSError:
        pass
    with open(path + ".part", "w") as f:
        f.write(p["config"])
    os.replace(path + ".part", path)
    return {"changed": True}


NOLOGIN = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")


def op_service_user(p):
    """The service user (created when missing, as root only) and the cache directory it owns.
    Returns what was changed, so that op_undo_service_user can put the node back as it was."""
    import pwd

    root = _root(p)
    cache = os.path.join(root, "cache")
    done = {"created_user": None, "made": [], "chowned": []}
    name = p.get("user") if os.geteuid() == 0 else None
    if name:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            shell = next((s for s in NOLOGIN if os.path.exists(s)), "/bin/false")
            r = subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--home-dir",
                    "/nonexistent",
                    "--shell",
                    shell,
                    "--comment",
                    "fleetd ggml RPC server",
                    name,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if r.returncode != 0:
                raise RuntimeError(
                    "useradd %s: %s" % (name, (r.stderr.strip().splitlines() or ["failed"])[-1])
                )
            done["created_user"] = name
            with open(os.path.join(root, ".service-user"), "w") as f:
                f.write(name + "\n")
            entry = pwd.getpwnam(name)
    if name:
        _check_interpreter(root, name, entry, done)
    if not os.path.isdir(cache):
        os.makedirs(cache, mode=0o750)
        done["made"].append(cache)
    if name:
        st = os.stat(cache)
        if (st.st_uid, st.st_gid) != (entry.pw_uid, entry.pw_gid):
            done["chowned"].append([cache, st.st_uid, st.st_gid])
            os.chown(cache, entry.pw_uid, entry.pw_gid)
        os.chmod(cache, 0o750)
    return done


def _check_interpreter(root, name, entry, done):
    """The releases' venvs are made from this interpreter: the service user must be able to
    read its standard library (not so for one under root's 0700 home, e.g. pyenv's)."""
    r = subprocess.run(
        [sys.executable, "-c", "import encodings.idna, json, ssl"],
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    if r.returncode != 0:
        if done["created_user"]:
            _remove_user(root, name)
        raise RuntimeError(
            "%s cannot run %s (%s): give fleetctl --python a system interpreter, e.g. "
            "/usr/bin/python3"
            % (name, sys.executable, (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1])
        )


def op_undo_service_user(p):
    """Reverse op_service_user's record: ownership back, made directories and a created user gone."""
    import shutil

    done = p["done"]
    for path, uid, gid in done["chowned"]:
        if os.path.isdir(path):
            os.chown(path, uid, gid)
    for path in done["made"]:
        shutil.rmtree(path, ignore_errors=True)
    if done["created_user"]:
        _remove_user(_root(p), done["created_user"])
    return {"undone": True}


def _remove_user(root, name):
    # userdel refuses (exit 8) while a process runs as the user: the daemon's compute workers can
    # outlive the supervisor by a moment. They are this install's, so they go first.
    import pwd

    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        uid = None
    deadline = time.monotonic() + 10
    while True:
        if uid is not None:
            _kill_processes_of(uid)
        rc = subprocess.run(["userdel", name], capture_output=True, timeout=60).returncode
        if rc != 8 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    subprocess.run(["groupdel", name], capture_output=True, timeout=60)  # --user-group's, if left
    try:
        os.unlink(os.path.join(root, ".service-user"))
    except OSError:
        pass


def op_link(p):
    root = _root(p)
    if p["release"] is None:  # no release current (a roll-back on a fresh node)
        if os.path.lexists(os.path.join(root, "current")):
            os.unlink(os.path.join(root, "current"))
        return {"current": None}
    tmp = os.path.join(root, "current.part")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", p["release"]), tmp)
    os.replace(tmp, os.path.join(root, "current"))
    return {"current": p["release"]}


def op_stop(p):
    """Stop fleetd: systemd's unit, and the supervisor's process group (SIGTERM, SIGKILL after
    `timeout`); says whether a supervised fleetd was running."""
    root = _root(p)
    if _use_systemd(p):
        _systemctl("stop", UNIT)
    running = _read_pidfile(root)
    if running is None:
        return {"stopped": False}
    os.killpg(running["pid"], signal.SIGTERM)
    deadline = time.monotonic() + p.get("timeout", 15)
    while time.monotonic() < deadline and _read_pidfile(root) is not None:
        time.sleep(0.1)
    if _read_pidfile(root) is not None:
        os.killpg(running["pid"], signal.SIGKILL)
    try:
        os.unlink(os.path.join(root, "fleetd.pid"))
    except OSError:
        pass
    return {"stopped": True}


def op_start(p):
    """Start the release: as a systemd unit where systemd runs (written, enabled, restarted), else
    under fleetd.supervise in its own session with the pid file written."""
    root = _root(p)
    release = p["release"]
    venv = os.path.join(root, "releases", release)
    config = os.path.join(root, "fleetd.toml")
    if _use_systemd(p):
        unit = _unit_path()
        os.makedirs(os.path.dirname(unit), exist_ok=True)
        with open(unit + ".part", "w") as f:
            f.write(p.get("unit") or unit_text(root, p.get("user") if os.geteuid() == 0 else None))
        os.replace(unit + ".part", unit)
        _systemctl("daemon-reload")
        _systemctl("enable", UNIT)
        r = _systemctl("restart", UNIT)
        if r.returncode != 0:
            raise RuntimeError("systemctl restart: " + r.stderr.strip())
        return {"pid": 0, "manager": "systemd"}
    env = None
    user = p.get("user") if os.geteuid() == 0 else None
    if user:  # the service user's environment, as systemd's User= gives it: nothing of root's
        import pwd  # home (fleetd looks for a ggml build cache under $HOME before it drops)

        entry = pwd.getpwnam(user)
        env = dict(os.environ, HOME=entry.pw_dir, USER=user, LOGNAME=user)
    log = open(os.path.join(root, "fleetd.log"), "ab")
    proc = subprocess.Popen(
        [
            os.path.join(venv, "bin", "python"),
            "-m",
            "fleetd.supervise",
            "--",
            os.path.join(venv, "bin", "fleetd"),
            "--config",
            config,
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
        close_fds=True,
        env=env,
    )
    with open(os.path.join(root, "fleetd.pid.part"), "w") as f:
        f.write(f"{proc.pid} {release}\n")
    os.replace(os.path.join(root, "fleetd.pid.part"), os.path.join(root, "fleetd.pid"))
    return {"pid": proc.pid, "manager": "supervisor"}


def _unit_path():
    unit_dir = "/etc/systemd/system" if os.geteuid() == 0 else os.path.expanduser("~/.config/systemd/user")
    return os.path.join(unit_dir, UNIT)


# The system unit's sandbox (the Ansible role's fleetd.service.j2 writes the same lines).
# MemoryDenyWriteExecute is left off: ctypes callbacks need memory libffi maps writable and
# executable unless it was built with static trampolines (libffi 3.4 on x86-64 has them: fleetd
# loads ggml and runs a callback under the kernel's PR_SET_MDWE), and the planned cupy device's
# CUDA JIT needs W+X pages too. fleetd itself generates no code.
SANDBOX = (
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "PrivateDevices=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "ProtectProc=invisible",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "RemoveIPC=yes",
    "UMask=0027",
    # TCP (RPC, peer links, the control API) and AF_UNIX (logging, socketpairs); nothing else.
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
    "SystemCallArchitectures=native",
)


def unit_text(root, user):
    """fleetd.service: as root with a service user, run as that user inside the sandbox, with
    write access to the cache directory only; a user unit (no root) as before."""
    lines = [
        "[Unit]",
        "Description=fleetd ggml RPC server",
        "After=network-online.target",
        "StartLimitIntervalSec=60",
        "StartLimitBurst=10",
        "",
        "[Service]",
        f"ExecStart={root}/current/bin/fleetd --config {root}/fleetd.toml",
        # as ansible's unit: above fleetd's own caps (fleetd(8) LIMITS), so those act first
        "Restart=always",
        "RestartSec=2",
        "LimitNOFILE=8192",
        "TasksMax=2048",
    ]
    if user:
        lines += [f"User={user}", f"Group={user}", *SANDBOX, f"ReadWritePaths={root}/cache"]
    lines += ["", "[Install]", f"WantedBy={'multi-user.target' if os.geteuid() == 0 else 'default.target'}"]
    return "\n".join(lines) + "\n"


# One probe: short, since op_health retries it until its deadline.
PROBE_TIMEOUT_S = 2.0


def _probe(venv, port):
    """HELLO on 127.0.0.1:port with the release's own interpreter and fleetd.client.probe, so a
    pass also proves the installed fleetd imports. (version, features), or OSError with why."""
    args = [
        os.path.join(venv, "bin", "python"),
        "-m",
        "fleetd.client.probe",
        f"127.0.0.1:{port}",
        "--timeout",
        str(PROBE_TIMEOUT_S),
    ]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        raise OSError(f"fleetd.client.probe: no answer within {PROBE_TIMEOUT_S + 30:g}s") from None
    try:
        answer = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # no JSON line: it did not even start (a broken install)
        raise OSError(
            "fleetd.client.probe: exit %d: %s"
            % (r.returncode, (r.stderr.strip().splitlines() or ["no output"])[-1])
        ) from None
    if r.returncode != 0 or "error" in answer:
        raise OSError(answer.get("error") or f"fleetd.client.probe: exit {r.returncode}")
    return answer["version"], answer["features"]


def op_health(p):
    """HELLO on the RPC port through the release's fleetd.client.probe, retried until `timeout`;
    on failure, the last reason and the log's tail."""
    root = _root(p)
    venv = os.path.join(root, "releases", p["release"])
    deadline = time.monotonic() + p.get("timeout", 30)
    last = "no attempt"
    while time.monotonic() < deadline:
        try:
            version, features = _probe(venv, p["port"])
            return {"ok": True, "version": version, "features": features}
        except OSError as exc:
            last = str(exc)
        time.sleep(0.3)
    try:
        tail = open(os.path.join(root, "fleetd.log"), errors="replace").read().splitlines()[-5:]
    except OSError:
        tail = []
    return {"ok": False, "reason": last, "log": tail}


def op_logs(p):
    # `path`: a log the daemon reports itself (--log-file: a demo, a lab, a hand-started fleetd)
    path = p.get("path") or os.path.join(_root(p), "fleetd.log")
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        lines = []
    return {"lines": lines[-p.get("lines", 50) :]}


def op_remove_release(p):
    import shutil

    shutil.rmtree(os.path.join(_root(p), "releases", p["release"]), ignore_errors=True)
    return {"removed": p["release"]}


def _kill_processes_of(uid):
    """SIGKILL every process whose real uid is `uid` (read from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                real = next(line.split()[1] for line in f if line.startswith("Uid:"))
            if int(real) == uid:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, StopIteration, ValueError):
            pass  # gone meanwhile


def op_uninstall(p):
    """Stop fleetd, disable the unit, remove a service user this agent created, then all of ROOT."""
    import shutil

    op_stop(p)
    if _use_systemd(p):
        _systemctl("disable", UNIT)
    try:
        created = open(os.path.join(_root(p), ".service-user")).read().strip()
    except OSError:
        created = None
    if created:  # a user this agent made goes with the install; one that was there stays
        _remove_user(_root(p), created)
    shutil.rmtree(_root(p), ignore_errors=True)
    return {"removed": _root(p)}


OPS = {name[3:]: fn for name, fn in list(globals().items()) if name.startswith("op_")}


def main():
    op, params = sys.argv[1], json.loads(sys.argv[2])
    try:
        print(json.dumps({"ok": True, "result": OPS[op](params)}))
    except Exception as exc:  # reported to fleetctl as one line, never a traceback
        print(json.dumps({"ok": False, "error": f"{op}: {type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
