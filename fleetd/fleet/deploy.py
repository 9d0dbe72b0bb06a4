"""fleetctl deploy: install, configure, start and health-check fleetd on every node.

Per node, each step checks before it acts (fabric's habit), so a second deploy of the same
build changes nothing and says so:

    check      Python >= 3.11, free disk, the RPC port free or held by our own daemon
    upload     wheels the node does not have yet (SFTP); nodes need no package index
    install    a venv per release (<version>-<wheel sha>) from those wheels, --no-index
    configure  fleetd.toml: ports, devices, peer allow-list = the fleet's own endpoints, the
               cache directory; as root, the service user (created when missing) owning it
    start      systemd where it runs (as root: User= and a sandbox), else a supervised
               background process + pid file (as root: fleetd drops to the service user)
    health     HELLO on the RPC port with the release's own python -m fleetd.client.probe
               (so the installed fleetd imports), then /v1/status through the control API;
               a device that came up as another kind than configured (cpu -> numpy: the ggml
               library did not load) is a warning of the outcome, the node stays deployed

The wheel carries the operator's portable ggml build (every *.so of
~/.cache/fleetd/llama.cpp-<v>/lib-portable, or --ggml-lib DIR) in fleetd/compute/ggml/_lib, so
a node without a compiler gets ggml's CPU kernels; without one it runs the numpy device.

A failed configure, start or health check rolls the node back to the release, config and unit it
had before (or removes the new one if it had none), removes a service user this deploy created,
and reports why.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleetd import __version__
from fleetd.compute.ggml.lib import ONE_LIBRARY
from fleetd.errors import FleetError
from fleetd.fleet import agent
from fleetd.fleet.control_docs import NodeStatus
from fleetd.fleet.node import Fleet, Node
from fleetd.fleet.remote import Shell, shell_for
from fleetd.fleet.ssh import NodeError
from fleetd.tools import portable_ggml_dir

MIN_PYTHON = (3, 11)
MIN_FREE_BYTES = 512 * 1024 * 1024
HEALTH_TIMEOUT_S = 30.0
# After HELLO answered: how long the control API may take to answer /v1/status, and how often
# it is asked meanwhile.
CONTROL_HEALTH_TIMEOUT_S = 15.0
CONTROL_HEALTH_RETRY_S = 0.25
STEPS = ("check", "upload", "install", "configure", "start", "health")
WHEEL_CACHE = Path.home() / ".cache" / "fleetd" / "wheels"
# Where the wheel carries the ggml libraries (fleetd/compute/ggml/lib.py looks there last).
WHEEL_LIB_DIR = "fleetd/compute/ggml/_lib"
PORTABLE_BUILD = "FLEETD_GGML_PORTABLE=1 bash scripts/build-llama.sh ggml"
# The device kind /v1/status should show for a configured device; others are not checked.
EXPECTED_KIND = {"cpu": "ggml", "numpy": "numpy"}
# Deploying as root, fleetd runs as this system user (no home, no login shell), never as root.
SERVICE_USER = "fleetd"


@dataclass(frozen=True)
class Build:
    """The wheels a deploy ships: fleetd's own wheel plus the daemon's dependencies."""

    wheel: Path
    deps: tuple[Path, ...]
    version: str
    sha: str
    requirements: tuple[str, ...]  # the daemon's, from the wheel's metadata: what nodes install
    ggml_libs: tuple[str, ...] = ()  # the *.so files the wheel carries for the cpu device
    warning: str | None = None  # one line for the operator (no ggml libraries to ship)

    @property
    def release(self) -> str:
        return f"{self.version}-{self.sha[:12]}"

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.wheel, *self.deps)


def project_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise FleetError(f"no pyproject.toml above {__file__}: pass --wheel-dir with a built fleetd wheel")
    return root


def _pip(*args: str) -> subprocess.CompletedProcess:
    # A fixed zip timestamp makes the wheel reproducible: the same source gives the same sha,
    # so the same release name, so a second deploy is a no-op.
    env = dict(os.environ, SOURCE_DATE_EPOCH="315532800")
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"],
        capture_output=True,
        text=True,
        env=env,
    )


# Build artefacts and local state that never go into the wheel: at the top of the tree, and anywhere.
_TOP_LEFTOVERS = {".venv", ".git", "build", "dist", ".pytest_cache"}
_LEFTOVERS = shutil.ignore_patterns("__pycache__", "*.egg-info")


def _clean_copy(src: Path, dst: Path) -> Path:
    def ignore(directory: str, names: list[str]) -> set[str]:
        top = _TOP_LEFTOVERS & set(names) if Path(directory) == Path(src) else set()
        return top | _LEFTOVERS(directory, names)

    shutil.copytree(src, dst, ignore=ignore, symlinks=True)
    return dst


def portable_libs(directory: Path) -> list[Path]:
    """The *.so files of a portable ggml build to ship; FleetError says why `directory` is none.
    Every *.so goes (libggml-base, each libggml-cpu-<variant>, helpers built next to them),
    symlinks as the files they name: a wheel holds no links."""
    for native in ("libggml-cpu.so", ONE_LIBRARY):
        if (directory / native).exists():
            raise FleetError(
                f"{directory} is a native ggml build ({native}, -march=native: it may "
                "not run on another CPU), not a portable one"
            )
    if not (directory / "libggml-base.so").exists():
        raise FleetError(f"no portable ggml build in {directory} (no libggml-base.so)")
    if not list(directory.glob("libggml-cpu-*.so")):
        raise FleetError(f"{directory}: no libggml-cpu-<variant>.so")
    return sorted(directory.glob("*.so"))


# An extra's requirement ends in a marker naming it: `rich>=13; extra == "ctl"`.
_EXTRA_MARKER = re.compile(r";.*\bextra\s*==")


def daemon_requirements(wheel: Path) -> tuple[str, ...]:
    """The requirements of `wheel` outside any extra: the daemon's (fleetctl's and the TUI's are
    the `ctl` extra and stay off nodes). Read from the wheel that ships, not from the fleetd
    installed here: that may be another checkout's, or an editable install older than its tree."""
    with zipfile.ZipFile(wheel) as whl:
        metadata = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        dist_info = zipfile.Path(whl, metadata.rsplit("/", 1)[0] + "/")
        requires = importlib.metadata.PathDistribution(dist_info).requires or []
    return tuple(r for r in requires if not _EXTRA_MARKER.search(r))


def _wheel_libs(wheel: Path) -> tuple[str, ...]:
    with zipfile.ZipFile(wheel) as whl:
        return tuple(
            sorted(
                Path(n).name
                for n in whl.namelist()
                if n.startswith(WHEEL_LIB_DIR + "/") and n.endswith(".so")
            )
        )


def _ship_ggml(clean: Path, libs: list[Path]) -> None:
    """Put `libs` (and nothing else: a tree's own _lib may hold a native build) into the copy."""
    target = clean / WHEEL_LIB_DIR
    shutil.rmtree(target, ignore_errors=True)
    if not libs:
        return
    target.mkdir(parents=True)
    for lib in libs:
        shutil.copyfile(lib, target / lib.name)  # follows the soname links
        (target / lib.name).chmod(0o755)


def build(source: Path | None = None, wheel_dir: Path | None = None, ggml_lib: Path | None = None) -> Build:
    """Build fleetd's wheel from `source` (default: this checkout) with the portable ggml build
    of `ggml_lib` (default: the build cache's lib-portable) inside, or take the one in
    `wheel_dir`; gather the dependency wheels into a cache (offline first, then the index)."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    warning = None
    if wheel_dir is not None:
        if ggml_lib is not None:
            raise FleetError("--ggml-lib goes into a wheel fleetctl builds; --wheel-dir takes a built one")
        wheels = sorted(Path(wheel_dir).glob("fleetd-*.whl"))
        if not wheels:
            raise FleetError(f"--wheel-dir {wheel_dir}: no fleetd-*.whl in it")
        wheel = wheels[-1]
        if not _wheel_libs(wheel):
            warning = (
                f"{wheel.name} carries no ggml libraries: nodes will run the numpy device "
                f"(build them with {PORTABLE_BUILD}, then let fleetctl build the wheel)"
            )
    else:
        if ggml_lib is not None:
            libs = portable_libs(Path(ggml_lib))  # asked for by name: a bad one is an error
        else:
            try:
                libs = portable_libs(portable_ggml_dir())
            except FleetError as exc:
                libs = []
                warning = (
                    f"{exc}: nodes will run the numpy device (build it with {PORTABLE_BUILD}, "
                    "or pass --ggml-lib DIR)"
                )
        out = Path(tempfile.mkdtemp(prefix="fleetd-wheel-"))
        src = source or project_root()
        # Built from a copy without build leftovers: setuptools ships whatever an earlier build
        # left in build/lib, modules removed since included.
        clean = _clean_copy(src, out / "src")
        try:
            _ship_ggml(clean, libs)
            r = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(clean))
            if r.returncode != 0:  # this environment lacks the build backend: let pip fetch it
                r = _pip("wheel", "--no-deps", "-w", str(out), str(clean))
        finally:
            shutil.rmtree(clean, ignore_errors=True)
        if r.returncode != 0:
            raise FleetError(
                f"building the fleetd wheel from {src} failed: {r.stderr.strip().splitlines()[-1:]}"
            )
        wheel = next(out.glob("fleetd-*.whl"))
    version = wheel.name.split("-")[1]
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    requirements = daemon_requirements(wheel)
    deps_dir = WHEEL_CACHE / "deps"
    r = _pip("download", "--no-index", "--find-links", str(deps_dir), "-d", str(deps_dir), *requirements)
    if r.returncode != 0:
        r = _pip("download", "--only-binary=:all:", "-d", str(deps_dir), *requirements)
        if r.returncode != 0:
            raise FleetError(f"downloading daemon dependencies failed: {r.stderr.strip().splitlines()[-1:]}")
    deps = tuple(sorted(deps_dir.glob("*.whl")))
    return Build(wheel, deps, version, sha, requirements, _wheel_libs(wheel), warning)


def default_root(user: str | None) -> str:
    return "/opt/fleetd" if user == "root" else "~/.local/share/fleetd"


def node_config(node: Node, fleet: Fleet, root: str | None = None, user: str | None = None) -> str:
    """fleetd.toml for one node: its ports and devices, peers limited to the fleet's hosts, the
    cache directory under `root` (the node's install directory), the service user when root
    deploys."""
    s = node.spec
    peers = sorted({n.spec.host for n in fleet} | {"127.0.0.1"})
    devices = ", ".join(json.dumps(d) for d in s.devices)
    return (
        "# Written by fleetctl deploy; fleetd --config reads it.\n"
        f'host = "0.0.0.0"\nport = {s.rpc_port}\ncontrol_port = {s.control_port}\n'
        f"devices = [{devices}]\npeer_allow = [{', '.join(json.dumps(p) for p in peers)}]\n"
        f"allow = {json.dumps(sorted(set(peers) | {_operator_address(s.host)} - {None}))}\n"
        + (f"cache_dir = {json.dumps(root + '/cache')}\n" if root else "")
        + (f"user = {json.dumps(user)}\n" if user else "")
    )


def config_user(config: str | None) -> str | None:
    """The service user a fleetd.toml names (None: none, or no config)."""
    if not config:
        return None
    try:
        return tomllib.loads(config).get("user")
    except tomllib.TOMLDecodeError:
        return None


def _operator_address(host: str) -> str | None:
    """This machine's address as `host` sees it (a UDP connect only routes, sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


@dataclass
class NodeOutcome:
    """What deploy (or a lifecycle command) did on one node: a status, the releases, each step's
    result and any warnings."""

    node: str
    status: str  # deployed | unchanged | rolled-back | failed | planned
    release: str | None = None
    previous: str | None = None
    detail: str = ""
    steps: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # the node is up, but not as configured

    def as_dict(self) -> dict:
        return {
            "node": self.node,
            "status": self.status,
            "release": self.release,
            "previous": self.previous,
            "detail": self.detail,
            "steps": self.steps,
            "warnings": self.warnings,
        }


class Agent:
    """Calls into fleetd.fleet.agent on the node."""

    SOURCE = inspect.getsource(agent)

    def __init__(self, shell: Shell, root: str, python: str = "python3") -> None:
        self.shell, self.root, self.python = shell, root, python

    def __call__(self, op: str, _timeout: float = 300, **params) -> dict:
        params["root"] = self.root
        done = self.shell.python(self.SOURCE, op, json.dumps(params), python=self.python, timeout=_timeout)
        try:
            reply = json.loads(done.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise NodeError(
                f"agent {op}: exit {done.rc}: {(done.stderr or done.stdout).strip()[-200:]}"
            ) from None
        if not reply["ok"]:
            raise NodeError(reply["error"])
        return reply["result"]


Progress = Callable[[Node, str], None]


class Deployer:
    """Deploys one build to the nodes of a fleet, and runs the lifecycle commands on them."""

    def __init__(
        self,
        fleet: Fleet,
        build: Build | None,
        root: str | None = None,
        systemd: bool = True,
        progress: Progress | None = None,
        service_user: str | None = SERVICE_USER,
        python: str = "python3",
    ) -> None:
        self.fleet = fleet
        self.python = python  # the node's interpreter, which the releases' venvs are made from
        self.service_user = service_user
        self.build = build
        self.root = root
        self.systemd = systemd
        self.progress = progress or (lambda node, step: None)

    def agent(self, node: Node) -> Agent:
        return Agent(shell_for(node), self.root or default_root(node.spec.user), self.python)

    # -- deploy -----------------------------------------------------------------------------

    def plan(self, node: Node) -> NodeOutcome:
        """What deploy would do, from a read-only inspection (--dry-run)."""
        state = self.agent(node)("inspect", host="0.0.0.0", port=node.spec.rpc_port, systemd=self.systemd)
        steps = self._checks(node, state)
        b = self.build
        missing = self._missing_wheels(state)
        steps["upload"] = f"{len(missing)} wheel(s)" if missing else "nothing to upload"
        steps["install"] = "exists" if b.release in state["releases"] else f"new venv {b.release}"
        steps["configure"] = (
            "unchanged" if state["config"] == self._config(node, state) else "write fleetd.toml"
        )
        running = state["running"]
        up_to_date = running and running["release"] == b.release and steps["configure"] == "unchanged"
        steps["start"] = "already running" if up_to_date else ("restart" if running else "start")
        return NodeOutcome(node.name, "planned", b.release, state["current"], "", steps)

    def _user(self, state: dict) -> str | None:
        """The service user on this node: only root can make one and switch to it."""
        return self.service_user if state["euid"] == 0 else None

    def _config(self, node: Node, state: dict) -> str:
        return node_config(node, self.fleet, state["root"], self._user(state))

    def _wheel_path(self, f: Path) -> str:
        """fleetd's own wheel goes under its release (same file name, other content across
        builds); dependency wheels are immutable per file name and shared."""
        return f"wheels/{self.build.release}/{f.name}" if f == self.build.wheel else f"wheels/{f.name}"

    def _missing_wheels(self, state: dict) -> list[Path]:
        return [f for f in self.build.files if self._wheel_path(f)[len("wheels/") :] not in state["wheels"]]

    def _checks(self, node: Node, state: dict) -> dict:
        major, minor = (int(x) for x in state["python"].split("."))
        if (major, minor) < MIN_PYTHON:
            raise NodeError(f"python3 is {state['python']}, fleetd needs >= {'.'.join(map(str, MIN_PYTHON))}")
        if state["free_bytes"] < MIN_FREE_BYTES:
            raise NodeError(f"{state['free_bytes'] >> 20} MiB free, need {MIN_FREE_BYTES >> 20} MiB")
        if state["port"] == "busy":
            raise NodeError(self._port_holder(node))
        return {
            "check": f"python {state['python']}, {state['free_bytes'] >> 30} GiB free, port {state['port']}"
        }

    def _port_holder(self, node: Node) -> str:
        """Why the RPC port is busy, naming a fleetd that fleetctl did not deploy when it is one."""
        port, root = node.spec.rpc_port, self.root or default_root(node.spec.user)
        try:
            version = node.status().version
        except Exception:
            return f"RPC port {port} is held by another program (not a fleetd deployed under {root})"
        return (
            f"RPC port {port} is held by fleetd {version}, which fleetctl did not deploy (no "
            f"release under {root}): stop it first, or give this node another rpc_port"
        )

    def deploy(self, node: Node) -> NodeOutcome:
        """The deploy steps on one node (see the module docstring): unchanged when that build already
        runs healthy with this config, rolled back when configure, start or health fails."""
        b = self.build
        ag = self.agent(node)
        self.progress(node, "check")
        state = ag("inspect", host="0.0.0.0", port=node.spec.rpc_port, systemd=self.systemd)
        outcome = NodeOutcome(node.name, "deployed", b.release, state["current"])
        outcome.steps.update(self._checks(node, state))
        config = self._config(node, state)
        user = self._user(state)

        self.progress(node, "upload")
        ag("prepare", release=b.release)
        missing = self._missing_wheels(state)
        for f in missing:
            ag.shell.put(f, f"{ag.root}/{self._wheel_path(f)}")
        outcome.steps["upload"] = f"{len(missing)} wheel(s)"

        self.progress(node, "install")
        installed = ag(
            "install", release=b.release, wheel=b.wheel.name, requirements=list(b.requirements), _timeout=600
        )["installed"]
        outcome.steps["install"] = "new venv" if installed else "exists"

        running = state["running"]
        if (
            running
            and running["release"] == b.release
            and state["current"] == b.release
            and state["config"] == config
        ):
            self.progress(node, "health")
            health = ag("health", release=b.release, port=node.spec.rpc_port, timeout=5)
            if health["ok"]:
                outcome.status = "unchanged"
                outcome.detail = f"{b.release} already running"
                outcome.steps.update(configure="unchanged", start="already running", health="ok")
                problem, status = self._control_health(node)
                outcome.warnings = [problem] if problem else device_warnings(node, status)
                return outcome

        self.progress(node, "configure")
        previous_config = state["config"]
        done = None  # what op_service_user changed, undone on roll-back
        try:
            done = ag("service_user", user=user)
            changed = ag("configure", config=config)["changed"]
            outcome.steps["configure"] = ("written" if changed else "unchanged") + (
                f", runs as {user}" if user else ""
            )

            self.progress(node, "start")
            ag("stop", systemd=self.systemd)
            ag("link", release=b.release)
            ag("start", release=b.release, systemd=self.systemd, user=user)
            outcome.steps["start"] = "restarted" if running else "started"

            self.progress(node, "health")
            problem, status = self._health(node, ag, b.release)
        except NodeError as exc:  # a step that failed outright: the same way back
            problem, status = str(exc), None
        if problem is None:
            outcome.steps["health"] = "ok"
            outcome.warnings = device_warnings(node, status)
            return outcome
        outcome.steps[next((s for s in STEPS[3:] if s not in outcome.steps), "health")] = problem
        outcome.detail = self._roll_back(node, ag, state, previous_config, problem, done)
        outcome.status = "rolled-back" if state["current"] else "failed"
        return outcome

    def _health(self, node: Node, ag: Agent, release: str) -> tuple[str | None, NodeStatus | None]:
        """(None, its /v1/status) when `release` (the one started) is healthy, else (the reason, None)."""
        h = ag(
            "health",
            release=release,
            port=node.spec.rpc_port,
            timeout=HEALTH_TIMEOUT_S,
            _timeout=HEALTH_TIMEOUT_S + 60,
        )
        if not h["ok"]:
            log = " | ".join(h["log"][-2:])
            return f"no HELLO on port {node.spec.rpc_port}: {h['reason']}" + (
                f" (log: {log})" if log else ""
            ), None
        return self._control_health(node)

    def _control_health(self, node: Node) -> tuple[str | None, NodeStatus | None]:
        # The RPC port answering does not prove the control API is up yet (an older fleetd binds
        # it after the RPC port; a restart races with it): retry until a deadline, keep the reason.
        deadline = time.monotonic() + CONTROL_HEALTH_TIMEOUT_S
        while True:
            try:
                return None, node.status()  # parsed: an answer without a version raises, with that reason
            except Exception as exc:
                problem = f"control API: {exc}"
            if time.monotonic() >= deadline:
                return f"{problem} (gave up after {CONTROL_HEALTH_TIMEOUT_S:.0f}s)", None
            time.sleep(CONTROL_HEALTH_RETRY_S)

    def _roll_back(
        self,
        node: Node,
        ag: Agent,
        before: dict,
        previous_config: str | None,
        why: str,
        done: dict | None = None,
    ) -> str:
        b = self.build
        ag("stop", systemd=self.systemd)
        ag("configure", config=previous_config)  # None: none, as before
        if done is not None:  # the service user and cache directory as they were
            ag("undo_service_user", done=done)
        if before["current"] is None:
            ag("link", release=None)
            ag("remove_release", release=b.release)
            return f"health check failed, new release removed: {why}"
        ag("link", release=before["current"])
        if before["running"]:
            ag(
                "start",
                release=before["current"],
                systemd=self.systemd,
                user=config_user(previous_config),
                unit=before.get("unit"),
            )
            if self._health(node, ag, before["current"])[0] is not None:
                return f"health check failed ({why}); previous release {before['current']} did not come back"
        if b.release != before["current"]:
            ag("remove_release", release=b.release)
        return f"health check failed, rolled back to {before['current']}: {why}"

    # -- lifecycle commands -----------------------------------------------------------------

    def _not_deployed(self, node: Node, ag: Agent, state: dict) -> NodeError:
        """fleetd was never deployed under this root: say what was looked for, where, and
        whether something else holds the RPC port (a fleetd started by hand, say)."""
        port = node.spec.rpc_port
        held = (
            f"; RPC port {port} is held by a program fleetctl did not start"
            if state["port"] == "busy"
            else f"; nothing listens on RPC port {port}"
        )
        return NodeError(
            f"fleetd is not deployed here by fleetctl: no {ag.root}/current release link "
            f"and no {ag.root}/fleetd.pid (--root to look elsewhere){held}"
        )

    def _inspect(self, node: Node, ag: Agent) -> dict:
        return ag("inspect", host="0.0.0.0", port=node.spec.rpc_port, systemd=self.systemd)

    def current_release(self, node: Node, ag: Agent) -> str:
        state = self._inspect(node, ag)
        if state["current"] is None:
            raise self._not_deployed(node, ag, state)
        return state["current"]

    def start(self, node: Node) -> dict:
        ag = self.agent(node)
        release = self.current_release(node, ag)
        state = self._inspect(node, ag)
        if state["running"]:
            return {"status": "already running", "release": release}
        ag("start", release=release, systemd=self.systemd, user=self._user(state), unit=state.get("unit"))
        problem, status = self._health(node, ag, release)
        if problem:
            raise NodeError(problem)
        return {"status": "started", "release": release, "warnings": device_warnings(node, status)}

    def stop(self, node: Node) -> dict:
        ag = self.agent(node)
        state = self._inspect(node, ag)
        if state["current"] is None and state["running"] is None:
            raise self._not_deployed(node, ag, state)
        stopped = ag("stop", systemd=self.systemd)["stopped"]
        return {"status": "stopped" if stopped else f"was not running (no {ag.root}/fleetd.pid)"}

    def restart(self, node: Node) -> dict:
        self.stop(node)
        return self.start(node) | {"status": "restarted"}

    def logs(self, node: Node, lines: int = 50) -> dict:
        """The deployed daemon's log, else the log file a running fleetd reports (--log-file:
        what fleetctl demo and lab start, or one started by hand with it)."""
        ag = self.agent(node)
        got = ag("logs", lines=lines)["lines"]
        if got:
            return {"lines": got, "path": f"{ag.root}/fleetd.log"}
        state = self._inspect(node, ag)
        if state["current"] is None:
            try:
                reported = node.status().log_file
            except Exception:  # not running, or not answering: the deploy's story is the right one
                reported = None
            if reported:
                return {"lines": ag("logs", lines=lines, path=reported)["lines"], "path": reported}
            raise self._not_deployed(node, ag, state)
        return {"lines": got, "path": f"{ag.root}/fleetd.log"}

    def uninstall(self, node: Node) -> dict:
        return {"status": "removed", "root": self.agent(node)("uninstall", systemd=self.systemd)["removed"]}


def device_warnings(node: Node, status: NodeStatus) -> list[str]:
    """A line per device that /v1/status shows as another kind than the nodes file asked for
    (cpu that fell back to numpy: the shipped ggml library did not load there), with the
    daemon's reason when it gives one."""
    warnings = []
    for i, (asked, d) in enumerate(zip(node.spec.devices, status.devices)):
        want = EXPECTED_KIND.get(asked)
        if want is None or d.kind is None or d.kind == want:
            continue
        why = f": {d.fallback}" if d.fallback else ""
        warnings.append(f"device {i} ({asked}) runs on {d.kind}, not {want}{why}")
    return warnings


def inventory(fleet: Fleet) -> str:
    """An Ansible inventory (YAML) for ansible/deploy.yml."""
    lines = ["fleetd:", "  hosts:"]
    for n in fleet:
        s = n.spec
        lines.append(f"    {json.dumps(n.name)}:")
        lines.append(f"      ansible_host: {json.dumps(s.host)}")
        lines.append(f"      ansible_port: {s.ssh_port}")
        if s.user:
            lines.append(f"      ansible_user: {json.dumps(s.user)}")
        if s.is_local:
            lines.append("      ansible_connection: local")
        lines.append(f"      fleetd_rpc_port: {s.rpc_port}")
        lines.append(f"      fleetd_control_port: {s.control_port}")
        lines.append(f"      fleetd_devices: {json.dumps(','.join(s.devices))}")
    return "\n".join(lines) + "\n"


def clean_build(b: Build) -> None:
    """Remove a temporary wheel directory made by build()."""
    if b.wheel.parent.name.startswith("fleetd-wheel-"):
        shutil.rmtree(b.wheel.parent, ignore_errors=True)


__all__ = [
    "Build",
    "Deployer",
    "NodeOutcome",
    "SERVICE_USER",
    "STEPS",
    "build",
    "device_warnings",
    "inventory",
    "node_config",
    "portable_libs",
    "__version__",
]
