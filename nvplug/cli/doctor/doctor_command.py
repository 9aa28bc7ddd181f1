"""`nvplug doctor`: walk the failure chain from the kernel driver to the kubelet, in order.

Each step prints PASS, WARN or FAIL, the evidence, and the fix. The exit status is
1 when any step fails. Doctor loads NVML itself, in its own process, with the
operator's environment (so the library it finds is the one `nvplug run` would find
under the same environment).

`nvplug doctor --brief` is the exception: one line from the daemon's status endpoint
alone, with Node Problem Detector's exit statuses (see run_brief).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import socket
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nvplug import config
from nvplug.status import status_client as statusclient

StepVerdict = Literal["PASS", "WARN", "FAIL"]
LIB_NAME = "libnvidia-ml.so.1"


@dataclass
class Check:
    verdict: StepVerdict
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str | None = None


@dataclass
class _DoctorContext:
    args: argparse.Namespace
    lib_loaded: bool = False
    nvml_ok: bool = False
    minors: list[int] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    statusclient.add_arguments(parser)
    parser.add_argument(
        "--device-plugin-dir",
        type=Path,
        default=Path("/var/lib/kubelet/device-plugins"),
        help="the kubelet's device-plugin directory (default: %(default)s)",
    )
    parser.add_argument(
        "--dev-root", type=Path, default=Path("/"), help="root under which /dev/nvidia* live (default: %(default)s)"
    )
    parser.add_argument(
        "--proc-root", type=Path, default=Path("/proc"), help="where the driver's proc files live (default: /proc)"
    )
    parser.add_argument("--sys-root", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--cdi-spec-dir", type=Path, default=None, help="where nvplug writes its CDI spec (default: the config's)"
    )
    parser.add_argument(
        "--nfd-feature-file", type=Path, default=None, help="nvplug's NFD feature file (default: the config's)"
    )
    parser.add_argument(
        "--pod-resources-socket", type=Path, default=None, help="the kubelet's PodResources (default: the config's)"
    )
    parser.add_argument(
        "--brief",
        action="store_true",
        help="ask only the running daemon and print one line; exit 0 healthy, 1 a problem, 2 unknown "
        "(a Node Problem Detector custom plugin)",
    )


# --- 1. kernel driver ---------------------------------------------------------------------------


def check_driver(ctx: _DoctorContext) -> Check:
    version_file = ctx.args.proc_root / "driver/nvidia/version"
    module = ctx.args.sys_root / "module/nvidia"
    try:
        first = version_file.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        first = None
    if first:
        return Check("PASS", "the NVIDIA kernel driver is loaded", [f"{version_file}: {first}"])
    if module.is_dir():
        try:
            version = (module / "version").read_text().strip()
        except OSError:
            version = "version unknown"
        return Check("PASS", "the NVIDIA kernel driver is loaded", [f"{module} exists ({version})"])
    return Check(
        "FAIL",
        "the NVIDIA kernel driver is not loaded",
        [f"neither {version_file} nor {module} exists"],
        "load it: `modprobe nvidia` (check `dmesg | grep -i -e nvrm -e nvidia` for why it did not load: "
        "a missing build for this kernel, Secure Boot refusing an unsigned module, or nouveau holding the GPU)",
    )


# --- 2. libnvidia-ml.so.1 -----------------------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def library_path(lib: ctypes.CDLL) -> str | None:
    """Where the loader found `lib`: dladdr of one of its symbols, else /proc/self/maps."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        dladdr = libc.dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        symbol = ctypes.cast(lib.nvmlInit_v2, ctypes.c_void_p)
        if dladdr(symbol, ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnvidia-ml.so" in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def check_library(ctx: _DoctorContext) -> Check:
    try:
        lib = ctypes.CDLL(LIB_NAME)
    except OSError as err:
        search = os.environ.get("LD_LIBRARY_PATH")
        return Check(
            "FAIL",
            f"{LIB_NAME} does not load",
            [str(err), f"LD_LIBRARY_PATH={search}" if search else "LD_LIBRARY_PATH is not set"],
            "install the NVIDIA driver's NVML library (the `libnvidia-compute-<version>` / "
            "`nvidia-driver-cuda-libs` package, same version as the kernel module) and run `ldconfig`; "
            f"`ldconfig -p | grep {LIB_NAME}` must list it",
        )
    ctx.lib_loaded = True
    path = library_path(lib)
    evidence = [f"loaded from {path}" if path else "loaded (its path could not be read)"]
    if path and os.path.realpath(path) != path:
        evidence.append(f"which is {os.path.realpath(path)}")
    return Check("PASS", f"{LIB_NAME} loads", evidence)


# --- 3. NVML initialises ------------------------------------------------------------------------


def _nvml_fix(code: int | None) -> tuple[str, str]:
    """(what it means, the fix) for an nvmlInit error."""
    import pynvml  # type: ignore[import-untyped]

    fixes: dict[int, tuple[str, str]] = {
        pynvml.NVML_ERROR_NO_PERMISSION: (
            "no permission to the GPUs",
            "run nvplug as root (the unit does) and check /dev/nvidiactl and /dev/nvidia* are rw for root "
            "(a device cgroup or an LSM policy can also deny them)",
        ),
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
            "the NVML library and the kernel module are different driver versions",
            "reboot, or reload the driver (`rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`) "
            "so that the kernel module matches the library (typical after a driver upgrade without a reboot)",
        ),
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
            "the NVIDIA kernel driver is not loaded",
            "load it: `modprobe nvidia`; `dmesg | grep -i nvrm` says why it failed",
        ),
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
            f"{LIB_NAME} was not found",
            "see step 2: install the driver's NVML library",
        ),
    }
    return fixes.get(
        code if code is not None else -1,
        (
            "NVML failed",
            "check `nvidia-smi` and `dmesg | grep -i nvrm`; reinstall the driver if nvidia-smi fails the same way",
        ),
    )


def check_nvml(ctx: _DoctorContext) -> Check:
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - a broken install
        return Check("FAIL", "pynvml cannot be imported", [str(err)], "reinstall nvplug")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        code = getattr(err, "value", None)
        meaning, fix = _nvml_fix(code)
        return Check("FAIL", f"NVML does not initialise: {meaning}", [f"nvmlInit: {err} (NVML error {code})"], fix)
    try:
        evidence = []
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            evidence.append(f"driver {driver.decode() if isinstance(driver, bytes) else driver}")
        except pynvml.NVMLError as err:
            evidence.append(f"driver version unreadable: {err}")
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as err:
            return Check("FAIL", "NVML cannot count the GPUs", [f"nvmlDeviceGetCount: {err}"], _nvml_fix(None)[1])
        if count == 0:
            return Check(
                "FAIL",
                "NVML initialises but sees no GPU",
                [*evidence, "nvmlDeviceGetCount: 0"],
                "check `lspci -d 10de:` lists the GPUs and `dmesg | grep -i nvrm` for GPUs the driver refused "
                "(fallen off the bus, unsupported by this driver branch)",
            )
        problems = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                ctx.minors.append(int(pynvml.nvmlDeviceGetMinorNumber(handle)))
            except pynvml.NVMLError as err:
                problems.append(f"gpu {index}: {err}")
        ctx.nvml_ok = True
        evidence.append(f"{count} GPU{'s' if count != 1 else ''}")
        if problems:
            return Check(
                "WARN",
                "NVML initialises, but some GPUs cannot be read",
                evidence + problems,
                "see `nvidia-smi -q` and `dmesg | grep -i xid` for these GPUs",
            )
        return Check("PASS", "NVML initialises", evidence)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


# --- 4. device nodes ----------------------------------------------------------------------------


def check_device_nodes(ctx: _DoctorContext) -> Check:
    dev = ctx.args.dev_root / "dev"
    found = sorted(dev.glob("nvidia*"))
    names = [p.name for p in found]
    wanted = ["nvidiactl", *(f"nvidia{m}" for m in ctx.minors)]
    missing = [n for n in wanted if n not in names]
    if not ctx.minors and not any(n[len("nvidia") :].isdigit() for n in names):
        missing.append("nvidia<N> (no GPU node at all)")
    denied = []
    not_char = []
    for p in found:
        if p.is_dir():
            continue
        try:
            mode = p.stat().st_mode
        except OSError as err:
            denied.append(f"{p}: {err}")
            continue
        if not stat.S_ISCHR(mode):
            not_char.append(p.name)
        if not os.access(p, os.R_OK | os.W_OK):
            denied.append(f"{p}: not readable and writable by uid {os.geteuid()}")
    evidence = [f"{dev}: {' '.join(names) or 'no nvidia* node'}"]
    if not_char:
        evidence.append(f"not character devices (a test tree?): {' '.join(not_char)}")
    problems = [f"missing: {dev / n}" for n in missing] + denied
    if problems:
        return Check(
            "FAIL",
            "the NVIDIA device nodes are missing or not accessible",
            problems + evidence,
            "the nodes appear when the driver is used as root: run `nvidia-smi` once, or `nvidia-modprobe -c <minor>` "
            "per GPU, or enable nvidia-persistenced; they must be rw for root (crw-rw-rw- is the default)",
        )
    verdict: StepVerdict = "PASS"
    fix = None
    if os.geteuid() != 0:
        verdict = "WARN"
        fix = "run `nvplug doctor` as root to check the nodes as the service (root) sees them"
    return Check(verdict, f"{len(names)} device nodes present and rw", evidence, fix)


# --- 5. device-plugin directory -----------------------------------------------------------------


def check_plugin_dir(ctx: _DoctorContext) -> Check:
    directory: Path = ctx.args.device_plugin_dir
    if not directory.is_dir():
        return Check(
            "FAIL",
            "the device-plugin directory does not exist",
            [f"{directory}: not a directory"],
            "is the kubelet installed and is this its root dir? pass --device-plugin-dir "
            "(the kubelet's --root-dir + /device-plugins); the kubelet creates it when it starts",
        )
    try:
        fd, name = tempfile.mkstemp(prefix=".nvplug-doctor-", dir=directory)
        os.close(fd)
        Path(name).unlink()
    except OSError as err:
        return Check(
            "FAIL",
            "the device-plugin directory is not writable",
            [f"creating a file in {directory}: {err}"],
            "nvplug creates its socket there: the directory must be writable by root; check for a read-only "
            "mount (`findmnt -T " + str(directory) + "`) or ReadWritePaths= in a local drop-in of nvplug.service",
        )
    return Check("PASS", "the device-plugin directory is writable", [f"{directory}: created and removed a file"])


# --- 6. kubelet.sock ----------------------------------------------------------------------------


def check_kubelet(ctx: _DoctorContext) -> Check:
    sock_path: Path = ctx.args.device_plugin_dir / "kubelet.sock"
    fix_start = "start the kubelet (`systemctl status kubelet`, `journalctl -u kubelet`); nvplug registers when it is"
    try:
        mode = sock_path.stat().st_mode
    except FileNotFoundError:
        return Check("FAIL", "kubelet.sock does not exist", [f"{sock_path}: no such file"], fix_start)
    except OSError as err:
        return Check("FAIL", "kubelet.sock cannot be read", [f"{sock_path}: {err}"], fix_start)
    if not stat.S_ISSOCK(mode):
        return Check("FAIL", "kubelet.sock is not a socket", [f"{sock_path}: {stat.filemode(mode)}"], fix_start)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(sock_path))
        except OSError as err:
            return Check(
                "FAIL",
                "kubelet.sock refuses connections",
                [f"connect {sock_path}: {err}", "a stale socket: the kubelet that made it is gone or hung"],
                "restart the kubelet (`systemctl restart kubelet`); it recreates the socket",
            )
    import grpc

    with grpc.insecure_channel(f"unix://{sock_path}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=2.0)
        except grpc.FutureTimeoutError:
            return Check(
                "FAIL",
                "kubelet.sock accepts connections but does not answer gRPC within 2 s",
                [str(sock_path)],
                "the kubelet is hung or something else owns the socket: `journalctl -u kubelet`, restart it",
            )
    return Check("PASS", "the kubelet answers on kubelet.sock", [f"{sock_path}: gRPC channel ready"])


# --- 7. the daemon ------------------------------------------------------------------------------


def check_daemon(ctx: _DoctorContext) -> Check:
    listen = statusclient.listen_address(ctx.args.status_listen, ctx.args.config)
    try:
        doc = statusclient.status(listen)
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check(
            "FAIL",
            "the nvplug daemon does not answer",
            [str(err)],
            "`systemctl status nvplug` and `journalctl -u nvplug -p err`; start it with `systemctl start nvplug` "
            "(or pass --status-listen where it listens)",
        )
    evidence = [f"{listen}: nvplug {doc.get('version', '?')}, state revision {doc.get('revision', '?')}"]
    failures = []
    for key in ("nvml_error", "plan_error"):
        if doc.get(key):
            failures.append(f"{key.replace('_', ' ')}: {doc[key]}")
    resources = doc.get("resources") or []
    if not resources:
        failures.append("no resource is advertised")
    for r in resources:
        registered = bool(r.get("registered"))
        line = f"{r.get('name')}: {'registered' if registered else 'NOT registered'}"
        line += f", {r.get('devices', 0)} devices, {r.get('healthy', 0)} healthy"
        evidence.append(line)
        if not registered:
            failures.append(f"{r.get('name')} is not registered with the kubelet")
    unhealthy = []
    for g in doc.get("gpus") or []:
        if g.get("health") != "Healthy":
            unhealthy.append(f"unhealthy: gpu {g.get('index')} {g.get('uuid')} ({g.get('bus_id')}): {g.get('reason')}")
        for m in g.get("mig") or []:
            if m.get("health") != "Healthy" and g.get("health") == "Healthy":
                where = f"MIG {m.get('profile')} {m.get('uuid')} on gpu {g.get('index')}"
                unhealthy.append(f"unhealthy: {where}: {m.get('reason')}")
    warnings = []
    if doc.get("health_watch_error"):
        warnings.append(f"health watch error: {doc['health_watch_error']}")
    if failures:
        return Check(
            "FAIL",
            "the daemon runs but does not serve every resource",
            failures + evidence + unhealthy + warnings,
            "`journalctl -u nvplug -p warning` says why; registration waits for kubelet.sock (step 6) "
            "and NVML (step 3)",
        )
    total = sum(int(r.get("devices", 0)) for r in resources)
    healthy = sum(int(r.get("healthy", 0)) for r in resources)
    if unhealthy or warnings:
        return Check(
            "WARN",
            f"the daemon is registered: {total} devices advertised, {healthy} healthy",
            evidence + unhealthy + warnings,
            "`nvplug devices` says what each Unhealthy GPU waits for (`journalctl -u nvplug` has the evidence); "
            "a GPU whose fault needs a reset stays Unhealthy until it is reset: `nvidia-smi -r -i <bus id>` "
            "(no process on it) or a reboot, or `nvplug heal GPU --reset` (checks that no process uses it, "
            "then resets it); after a repair nvplug cannot see, `nvplug heal GPU` records that the GPU "
            "was fixed and probes it",
        )
    return Check("PASS", f"the daemon is registered: {total} devices advertised, all healthy", evidence)


# --- `doctor --brief`: one line for Node Problem Detector ----------------------------------------
#
# NPD runs it every invoke_interval: it asks the daemon's status endpoint and nothing
# else (no NVML, no kubelet probe), so it is cheap and cannot disturb the GPUs. The
# exit status is NPD's custom-plugin protocol; the one line is the condition's message.

BRIEF_OK, BRIEF_PROBLEM, BRIEF_UNKNOWN = 0, 1, 2
BRIEF_MAX = 300  # characters; packaging/npd/nvplug-gpu-health.json's max_output_length
BRIEF_TIMEOUT = 4.0  # seconds per socket operation: well under the plugin's 10 s timeout
_ITEM_MAX = 200  # one GPU's entry, so that a second one usually still fits
_CUT_MIN = 60  # an item cut shorter than this no longer says which device and why


def _one_line(text: Any, limit: int) -> str:
    """`text` on one line (NPD keeps only the first), at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


def _short_uuid(uuid: Any) -> str:
    """GPU-b52e1a2c... : enough to tell GPUs apart next to the index and the bus id."""
    text = str(uuid)
    kind, sep, rest = text.partition("-")
    return f"{kind}-{rest[:8]}..." if sep and len(rest) > 8 else text


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def brief_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(code, text) for each problem in a /status document, the node-wide ones first.

    Raises ValueError for a document whose shape is not the daemon's (unreadable: unknown).
    """
    resources = doc.get("resources") or []
    gpus = doc.get("gpus") or []
    if not isinstance(resources, list) or not all(isinstance(r, dict) for r in resources):
        raise ValueError("/status has no readable resources list")
    if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
        raise ValueError("/status has no readable gpus list")
    problems: list[tuple[str, str]] = []
    if doc.get("nvml_error"):
        problems.append(("NVPLUG_NVML_ERROR", f"NVML: {doc['nvml_error']}"))
    if doc.get("plan_error"):
        problems.append(("NVPLUG_PLAN_ERROR", f"resource plan: {doc['plan_error']}"))
    if not resources:
        problems.append(("NVPLUG_NO_RESOURCE", "no resource is advertised"))
    for r in resources:
        if not r.get("registered"):
            problems.append(("NVPLUG_NOT_REGISTERED", f"{r.get('name')} is not registered with the kubelet"))
    if doc.get("health_watch_error"):
        # No health events: an XID would go unseen, so the Healthy GPUs cannot be trusted.
        problems.append(("NVPLUG_HEALTH_EVENTS_UNAVAILABLE", str(doc["health_watch_error"])))
    for g in gpus:
        if g.get("health") != "Healthy":
            text = f"gpu {g.get('index')} {_short_uuid(g.get('uuid'))} ({g.get('bus_id')}): {g.get('reason')}"
            waiting = g.get("waiting_for")  # newer daemons: what an Unhealthy GPU waits for
            if isinstance(waiting, str) and waiting:
                text += f"; waiting for {waiting}"
            problems.append(("NVPLUG_GPU_UNHEALTHY", text))
            continue  # its MIG devices are out with it
        for m in g.get("mig") or []:
            if isinstance(m, dict) and m.get("health") != "Healthy":
                where = f"MIG {m.get('profile')} {_short_uuid(m.get('uuid'))} on gpu {g.get('index')}"
                problems.append(("NVPLUG_MIG_UNHEALTHY", f"{where}: {m.get('reason')}"))
    return problems


def brief_ok(doc: dict[str, Any]) -> str:
    gpus = doc.get("gpus") or []
    migs = sum(len(g.get("mig") or []) for g in gpus)
    names = ", ".join(str(r.get("name")) for r in doc.get("resources") or [])
    what = _plural(len(gpus), "GPU") + (f" and {_plural(migs, 'MIG device')}" if migs else "")
    return _one_line(f"ok: {what} healthy, {names} registered", BRIEF_MAX)


def brief_line(problems: list[tuple[str, str]], limit: int = BRIEF_MAX) -> str:
    """`CODE: item | item | OTHER_CODE: item | +N more`, within `limit` characters.

    A code is written where it changes, so that each item reads as what it is. An
    item that does not fit whole is cut rather than dropped while enough of it fits
    to name the device: a node-wide problem first must not hide which GPU is bad.
    """
    parts: list[str] = []
    previous = None
    for code, text in problems:
        item = _one_line(text, _ITEM_MAX)
        parts.append(item if code == previous else f"{code}: {item}")
        previous = code
    line = ""
    for shown, part in enumerate(parts):
        rest = len(parts) - shown - 1
        more = f" | +{rest} more" if rest else ""
        sep = " | " if line else ""
        room = limit - len(line) - len(sep) - len(more)
        if len(part) <= room:
            line += sep + part
        elif room >= _CUT_MIN or not line:
            return line + sep + _one_line(part, room) + more
        else:
            # The previous step left room for exactly this count.
            return f"{line} | +{rest + 1} more"
    return line


def run_brief(args: argparse.Namespace, out: Any = None) -> int:
    """One line and NPD's exit status: 0 healthy, 1 a problem, 2 unknown."""
    stream = out or sys.stdout
    try:
        listen = statusclient.listen_address(args.status_listen, args.config)
        try:
            doc = statusclient.status(listen, timeout=BRIEF_TIMEOUT)
        except (statusclient.StatusUnavailable, ValueError) as err:
            code, line = BRIEF_UNKNOWN, f"NVPLUG_STATUS_UNKNOWN: the nvplug daemon does not answer: {err}"
        else:
            try:
                problems = brief_problems(doc)
            except ValueError as err:
                code, line = BRIEF_UNKNOWN, f"NVPLUG_STATUS_UNKNOWN: {listen}: {err}"
            else:
                code = BRIEF_PROBLEM if problems else BRIEF_OK
                line = brief_line(problems) if problems else brief_ok(doc)
    except Exception as err:  # Python's own exit status for a crash is 1, which NPD reads as a problem
        code, line = BRIEF_UNKNOWN, f"NVPLUG_STATUS_UNKNOWN: doctor --brief failed: {type(err).__name__}: {err}"
    print(_one_line(line, BRIEF_MAX), file=stream)
    stream.flush()
    return code


# --- 8. the config ------------------------------------------------------------------------------


def check_config(ctx: _DoctorContext) -> Check:
    from nvplug.shaping.resource_plan import check, unserved_sharing

    path: Path | None = ctx.args.config
    try:
        cfg = config.load(path)
        check(cfg)
    except config.ConfigError as err:
        return Check(
            "FAIL",
            "the config is invalid",
            [str(err)],
            "fix the key named above (`nvplug config check FILE`), then `systemctl reload nvplug`",
        )
    names = dict.fromkeys([*(r.name for r in cfg.resources.gpus), *(r.name for r in cfg.resources.mig)])
    evidence = [f"{cfg.source}: resources {', '.join(names)}"]
    ignored = unserved_sharing(cfg)
    if ignored:
        return Check(
            "WARN",
            "the config is valid but has settings nvplug ignores",
            evidence + [f"sharing.timeSlicing for {name} is ignored" for name in ignored],
            "remove those sharing entries, or expect no time-slicing of them",
        )
    return Check("PASS", "the config is valid", evidence)


def _config(ctx: _DoctorContext) -> config.Config | Check:
    """The config for the steps that need it; a config that does not load is step 8's failure."""
    try:
        return config.load(ctx.args.config)
    except config.ConfigError as err:
        return Check("WARN", "not checked: the config is invalid (step 8)", [str(err)])


# --- 9. CDI spec -------------------------------------------------------------------------------


def check_cdi(ctx: _DoctorContext) -> Check:
    """Every name nvplug would hand out resolves in the runtimes' spec directories, defined once."""
    from nvplug.cli.cdi_command import node_specs
    from nvplug.sinks.cdi.cdi_files import SPEC_DIRS, conflicts, read_specs

    cfg = _config(ctx)
    if isinstance(cfg, Check):
        return cfg
    uses_cdi = [s for s in cfg.flags.plugin.device_list_strategy if s.startswith("cdi")]
    if cfg.cdi_spec_dir == "off" and ctx.args.cdi_spec_dir is None:
        return Check("PASS", "nvplug writes no CDI spec (nvplug.cdi.specDir: off) and hands out no CDI names")
    if not ctx.nvml_ok:
        return Check("WARN", "not checked: NVML does not work (step 3), so the node's devices are unknown")
    spec_dir: Path = ctx.args.cdi_spec_dir or Path(cfg.cdi_spec_dir)
    found = node_specs(cfg, ctx.args.dev_root, ctx.args.sys_root, ctx.args.proc_root)
    wanted = found.specs
    files = read_specs([*SPEC_DIRS, spec_dir])
    defined = {name for f in files if f.error is None for name in f.qualified()}
    names = [n for spec in wanted for n in spec.names() if not n.endswith("=all")]
    missing = [n for n in names if n not in defined]
    ours = [spec_dir / spec.file_name for spec in wanted]
    clashes = conflicts(files, ours, [spec.kind for spec in wanted])
    evidence = [f"{f.path}: {f.kind or '?'}, {len(f.names)} devices" + (f" (unreadable: {f.error})" if f.error else "")
                for f in files if f.kind in {s.kind for s in wanted} or f.error]  # fmt: skip
    how = f"deviceListStrategy {uses_cdi} hands them out" if uses_cdi else "no cdi strategy hands them out yet"
    if missing or clashes:
        shown = [f"does not resolve: {n}" for n in missing[:5]] + (
            [f"and {len(missing) - 5} more"] if missing[5:] else []
        )
        fixes = []
        if missing:
            fixes.append(
                f"the daemon writes {ours[0]} at start and on every change: `journalctl -u nvplug | grep CDI` "
                f"says why it could not (a unit must allow the directory: ReadWritePaths=-{spec_dir})"
            )
        if clashes:
            fixes.append(
                "remove the other spec of that kind (or its generator's unit), so that one spec defines each name"
            )
        verdict: StepVerdict = "FAIL" if uses_cdi or clashes else "WARN"
        problems = shown + clashes + evidence + list(found.problems)
        return Check(verdict, f"CDI names do not resolve cleanly ({how})", problems, "; ".join(fixes))
    summary = f"all {len(names)} CDI names resolve, each defined once ({how})"
    if found.problems:
        return Check(
            "WARN",
            summary + ", but the spec lacks driver files",
            [*evidence, *found.problems],
            "set flags.nvidiaDriverRoot to where the driver is installed (its etc/ld.so.cache must list the "
            "driver's libraries: run `ldconfig` there); without them containers get no libcuda.so.1",
        )
    return Check("PASS", summary, evidence)


# --- 10. node labels ----------------------------------------------------------------------------


def check_labels(ctx: _DoctorContext) -> Check:
    """The NFD feature file is there and says what this node is now."""
    from nvplug.sinks.gfd_labels import UNHEALTHY_COUNT, node_labels
    from nvplug.sinks.nfd_feature_file import read_machine
    from nvplug.sources.nvml_snapshot import scan_snapshot

    cfg = _config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if cfg.feature_file == "off" and ctx.args.nfd_feature_file is None:
        return Check("PASS", "nvplug writes no node labels (nvplug.labels.featureFile: off)")
    path: Path = ctx.args.nfd_feature_file or Path(cfg.feature_file)
    if not path.parent.is_dir():
        return Check(
            "WARN",
            "Node Feature Discovery's features.d does not exist: no node labels",
            [f"{path.parent}: no such directory"],
            "install NFD (its master with extraLabelNs: [nvidia.com]), then `systemctl restart nvplug` (the unit "
            "may write the directory only if it existed when it started); or set nvplug.labels.featureFile: off",
        )
    if not ctx.nvml_ok:
        return Check("WARN", "not checked: NVML does not work (step 3), so the node's labels are unknown")
    snap = scan_snapshot(ctx.args.sys_root, ctx.args.proc_root)
    want = node_labels(snap, cfg, read_machine(ctx.args.sys_root, [g.bus_id for g in snap.gpus]))
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        return Check(
            "FAIL",
            "the node label file is missing or unreadable",
            [f"{path}: {err.strerror}"],
            "the daemon writes it at start and on every change: `journalctl -u nvplug | grep 'NFD feature'` says why "
            f"it could not (a unit must allow the directory: ReadWritePaths=-{path.parent})",
        )
    have = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    have.pop(UNHEALTHY_COUNT, None)  # the daemon's health, which one scan cannot know
    wrong = [
        f"{k}: the file says {have[k]!r}, the node {v!r}" for k, v in sorted(want.items()) if k in have and have[k] != v
    ]
    wrong += [f"{k}: missing from the file (the node: {v!r})" for k, v in sorted(want.items()) if k not in have]
    wrong += [f"{k}: in the file ({have[k]!r}), not true of the node" for k in sorted(set(have) - set(want))]
    evidence = [f"{path}: {len(have)} labels"]
    if wrong:
        return Check(
            "FAIL",
            "the node labels do not match this node",
            wrong[:8] + evidence,
            "the daemon rewrites the file on every change: is it running (step 7)? `nvplug devices --labels` prints "
            "what it would write",
        )
    gfd = path.parent / "gfd"
    if gfd.exists() and gfd != path:
        return Check(
            "WARN",
            f"the {len(want)} node labels match this node, but GPU Feature Discovery writes the same keys too",
            [*evidence, f"{gfd}: GFD's file"],
            "run one of them: remove GFD (its DaemonSet), or set nvplug.labels.featureFile: off",
        )
    return Check("PASS", f"the {len(want)} node labels match this node", evidence)


# --- 11. the kubelet's view ---------------------------------------------------------------------


def check_kubelet_view(ctx: _DoctorContext) -> Check:
    """PodResources against nvplug's /status: what the kubelet believes of nvplug's devices."""
    import asyncio

    from nvplug.cli.doctor.crosscheck import CHECKPOINT, CheckpointEntry, cross_check, read_checkpoint
    from nvplug.kubelet.podresources_client import PodResourcesClient, PodResourcesUnavailable

    cfg = _config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if cfg.pod_resources_socket == "off" and ctx.args.pod_resources_socket is None:
        return Check("PASS", "not asked: PodResources is off (nvplug.podResources.socket: off)")
    path: Path = ctx.args.pod_resources_socket or Path(cfg.pod_resources_socket)
    try:
        doc = statusclient.status(statusclient.listen_address(ctx.args.status_listen, ctx.args.config))
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check("WARN", "not checked: the daemon does not answer (step 7)", [str(err)])

    async def ask() -> tuple[dict[str, list[str]], tuple[Any, ...]]:
        client = PodResourcesClient(path, rate=2.0, burst=2)
        try:
            return await client.allocatable(), await client.list_pods()
        finally:
            await client.close()

    try:
        allocatable, pods = asyncio.run(ask())
    except PodResourcesUnavailable as err:
        return Check(
            "WARN",
            "the kubelet's PodResources cannot be asked: which pod holds which GPU is unknown",
            [str(err)],
            "is the kubelet running (step 6)? PodResources is served since Kubernetes 1.13, "
            "GetAllocatableResources since 1.23 (GA 1.28)",
        )
    checkpoint: list[CheckpointEntry] = []
    evidence = [f"{path}: {sum(len(v) for v in allocatable.values())} allocatable devices, {len(pods)} containers "
                "holding devices"]  # fmt: skip
    try:
        checkpoint = read_checkpoint(ctx.args.device_plugin_dir / CHECKPOINT)
    except (OSError, ValueError) as err:
        evidence.append(f"the kubelet's checkpoint is not read: {err}")
    findings = cross_check(doc, allocatable, pods, checkpoint)
    if findings:
        return Check(
            "FAIL",
            "the kubelet's view of nvplug's devices disagrees with nvplug's",
            [f.problem for f in findings] + evidence,
            "; ".join(dict.fromkeys(f.fix for f in findings)),
        )
    return Check("PASS", "the kubelet's view agrees with nvplug's", evidence)


# --- 12. DRA -------------------------------------------------------------------------------------


def check_dra(ctx: _DoctorContext) -> Check:
    """The DRA plugin: registered with the kubelet, its kubeconfig accepted, its slices what the pool is."""
    import asyncio

    from nvplug.dra.api_client import ApiClient, KubeConfig, KubeConfigError
    from nvplug.dra.dra_driver import node_name
    from nvplug.dra.resource_slices import GROUP
    from nvplug.dra.slice_publisher import FAILURES, discover, list_slices

    cfg = _config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if not cfg.dra.enabled:
        return Check("PASS", "DRA is off (nvplug.dra.enabled: false)")
    driver, node = cfg.dra.driver_name, node_name(cfg)
    fix = "check the kubeconfig's server and credentials, and the RBAC the README's DRA section lists"
    try:
        kubeconfig = KubeConfig.load(Path(cfg.dra.kubeconfig))
    except KubeConfigError as err:
        return Check("FAIL", "the DRA plugin's kubeconfig cannot be used", [str(err)], fix)

    async def ask() -> tuple[str, list[dict[str, Any]]]:
        client = ApiClient(kubeconfig, timeout=5.0)
        try:
            version = await discover(client)
            return version, await list_slices(client, version, node, driver)
        finally:
            await client.close()

    try:
        version, slices = asyncio.run(ask())
    except FAILURES as err:
        return Check("FAIL", f"the API server cannot be asked with {kubeconfig.source}", [str(err)], fix)
    published = sum(len(s.get("spec", {}).get("devices") or []) for s in slices)
    evidence = [f"{kubeconfig.server}: {GROUP}/{version}, {len(slices)} ResourceSlices of {node} for {driver} "
                f"with {published} devices"]  # fmt: skip
    try:
        doc = statusclient.status(statusclient.listen_address(ctx.args.status_listen, ctx.args.config))
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check("WARN", "the API server answers; the daemon does not (step 7)", [*evidence, str(err)])
    dra = doc.get("dra") or {}
    problems = []
    if not dra.get("registered"):
        why = dra.get("registration_error") or "the kubelet has not asked GetInfo"
        where = dra.get("registry_socket")
        problems.append(
            f"the kubelet has not registered the DRA plugin ({why}); {where} must be in the directory "
            "the kubelet watches (a kubelet with DRA: Kubernetes 1.32 and later)"
        )
    if dra.get("error"):
        problems.append(f"the daemon cannot publish: {dra['error']}")
    if published != dra.get("pool_devices"):
        problems.append(f"the API server has {published} devices in the slices, the pool {dra.get('pool_devices')}")
    if problems:
        return Check("FAIL", "the DRA plugin is not in service", problems + evidence, fix)
    claims = len(dra.get("claims") or [])
    return Check("PASS", f"DRA {driver}: registered, {published} devices published, {claims} claims prepared", evidence)


STEPS: tuple[tuple[str, Callable[[_DoctorContext], Check]], ...] = (
    ("kernel driver", check_driver),
    (LIB_NAME, check_library),
    ("NVML init", check_nvml),
    ("device nodes", check_device_nodes),
    ("device-plugin dir", check_plugin_dir),
    ("kubelet.sock", check_kubelet),
    ("nvplug daemon", check_daemon),
    ("config", check_config),
    ("CDI spec", check_cdi),
    ("node labels", check_labels),
    ("kubelet's view", check_kubelet_view),
    ("DRA", check_dra),
)


def _guarded(step: Callable[[_DoctorContext], Check], ctx: _DoctorContext) -> Check:
    try:
        return step(ctx)
    except Exception as err:  # a doctor that crashes halfway helps nobody
        return Check("FAIL", "the check itself failed", [f"{type(err).__name__}: {err}"], "report this as a bug")


def run(args: argparse.Namespace, out: Any = None) -> int:
    if getattr(args, "brief", False):
        return run_brief(args, out)
    stream = out or sys.stdout
    ctx = _DoctorContext(args)
    counts = {"PASS": 0, "WARN": 0, "FAIL": 0}
    for number, (name, step) in enumerate(STEPS, 1):
        check = _guarded(step, ctx)
        counts[check.verdict] += 1
        print(f"{check.verdict}  {number}. {name}: {check.summary}", file=stream)
        for line in check.evidence:
            print(f"        {line}", file=stream)
        if check.fix and check.verdict != "PASS":
            print(f"      fix: {check.fix}", file=stream)
        stream.flush()
    print(f"\n{counts['FAIL']} failed, {counts['WARN']} warnings, {counts['PASS']} passed", file=stream)
    return 1 if counts["FAIL"] else 0
