/*
 * fakenvml.c - a fake libnvidia-ml.so.1 for running nvplug without a GPU.
 *
 * Loaded by the real pynvml binding through LD_LIBRARY_PATH.  The simulated
 * node comes from a scenario file (env FAKE_NVML_SCENARIO) read once, at the
 * first nvmlInit; afterwards the state lives in memory so that runtime
 * changes made over the control socket (env FAKE_NVML_CONTROL) persist
 * across nvmlShutdown/nvmlInit cycles.  See default.scenario for the syntax.
 * Compute modes are driver state and outlive the process: they live in a
 * state file (env FAKE_NVML_STATE_DIR; "Compute mode" below).
 *
 * Build: cc -shared -fPIC -O2 -Wall -Wextra -pthread -o libnvidia-ml.so.1 fakenvml.c
 *
 * Children share their parent's driver state, as every process on a real node
 * shares the driver's.  The process that binds the control socket (its owner)
 * writes each command that changed state and answered "ok" to the journal
 * FAKE_NVML_CONTROL.journal, after a first line "owner <pid>": a GPU given by
 * index is written by UUID, and an add without uuid= gets the one it made.  A
 * process whose parent is the journal's owner binds no socket: its first
 * nvmlInit loads the scenario and applies the whole journal, and from then on
 * it applies each line as it is written (inotify), so that an XID sent to the
 * owner reaches the child's event sets as well.  Queries (ping, state, calls)
 * are not written; a child's counters and waits are its own, and the owner's
 * state does not show them.  Any other process binds the socket as before and
 * starts a journal of its own.
 *
 * Control socket: a unix datagram socket served by a thread started at the
 * first nvmlInit call (successful or not).  One command per datagram; a bound
 * sender gets "ok[ details]" or "error: <reason>".  <gpu> is an index in the
 * current enumeration or a UUID.
 *   ping | state                        state: "ok key=value ... | idx uuid flags ra=N cm=N
 *                                       [ mig=prof/gi/ci/uuid,...|-][ procs=...][ blocks=fn,...][ waiting=N]
 *                                       | ..." (cm: compute mode; blocks: below)
 *   xid <gpu> <code> [gi ci]            event 0x8, eventData = code
 *   ecc <gpu> sbe|dbe [count]           count corrected / uncorrected ECC errors (default 1),
 *                                       volatile and aggregate (nvmlDeviceGetTotalEccErrors), and
 *                                       queue one event 0x1 / 0x2; unsupported=ecc: an error
 *   event <gpu> <hex type> <data> [gi ci]
 *   lose <gpu>                          GPU_IS_LOST from now on, event 0x4000 (once)
 *   remove <gpu>                        like lose now; not enumerated from the next 0->1 init
 *   restore <gpu>                       undo lose/remove, clear the probes below and the
 *                                       volatile ECC counts and NVLink counts and set every GPM
 *                                       level and NVLink rate to 0 (as a reset does); retired
 *                                       pages stay retired
 *   pending_pages <gpu> 0|1
 *   remap <gpu> <pending> <failure> [corr unc]
 *   recovery_action <gpu> <n>           field 230 value, event 0x8000 with data n
 *   add <gpu-line key=value ...>        enumerated from the next 0->1 init; reuses gone-for-good slots
 *   link <gpu> <gpu> [nvlink=N] [pcie=LEVEL]
 *   init_error <nvmlReturn>             later nvmlInit calls fail with it (0: succeed)
 *   wait_error <nvmlReturn> <count>     the next <count> nvmlEventSetWait(_v2) calls return it at
 *                                       once, leaving queued events; blocked waiters wake to it;
 *                                       count -1: until "wait_error 0 0" (or count 0) clears it
 *   calls                               "ok total=N name=n ...": calls per exported function
 *                                       (not nvmlErrorString), non-zero ones, sorted by name
 *   calls reset                         zero those counters
 *   mig <gpu> mode 0|1                  MIG mode now (current = pending); 0 also clears the layout
 *   mig <gpu> layout <p>[,<p>...] | -   replace the GPU's MIG devices (profiles below), gi ids
 *                                       1, 2, ... in order, ci 0 each; "-" clears.  Both take
 *                                       effect at once (no nvmlInit needed) and queue event 0x100
 *                                       (MigConfigChange, data 0); replaced devices' handles go stale
 *                                       and the processes on them are dropped
 *   procs <gpu> <proc>[,<proc>...] | -  replace the GPU's running processes (syntax below); "-"
 *                                       clears.  At once, no event; restore keeps them.  The
 *                                       compute mode limits them (below)
 *   compute_mode <gpu> [<mode>]         "ok N": the GPU's compute mode; with <mode> (0-3, or DEFAULT
 *                                       EXCLUSIVE_THREAD PROHIBITED EXCLUSIVE_PROCESS) set it, as an
 *                                       operator's nvidia-smi -c does: no root check, error for a
 *                                       lost GPU or one in MIG mode; written to the state file
 *   telemetry <gpu> key=value ...       what the device figures answer: util mem_util enc_util
 *                                       dec_util (%), temp mem_temp (C), power_mw, energy_mj (then
 *                                       growing at power_mw), sm_clock mem_clock (MHz), throttle
 *                                       (clocks event reasons; while a policy's reasons are held
 *                                       its violation time grows: nvmlDeviceGetViolationStatus),
 *                                       pcie_replays, reserved_mib (framebuffer used before any
 *                                       process's memory); none on a MIG device
 *                                       handle, no utilization with MIG on; mem_temp is field 82
 *                                       (nvmlDeviceGetFieldValues), which unsupported=memory_temp
 *                                       refuses, as a GPU without HBM does; nvlink_tx nvlink_rx
 *                                       (MiB/s) the NVLink traffic from now on, which fields
 *                                       138-141 count (unsupported=nvlink: an error).  Energy,
 *                                       PCIe replays, ECC totals, retired pages and remapped rows
 *                                       are fields too (3-6, 29-31, 83, 94, 142-145), each as
 *                                       its own call gives it
 *   samples <gpu> <pid>:<sm>:<mem>[:<enc>:<dec>][,...] | -
 *                                       process utilization samples stamped now (realtime us,
 *                                       rising per GPU; the last SAMPLES_MAX kept), which
 *                                       nvmlDeviceGetProcessUtilization gives one entry per
 *                                       process for (their mean); "-" forgets them
 *   retire <gpu> sbe|dbe [count]        "ok pages=N": retire count pages (default 1, up to
 *                                       RETIRED_MAX kept per cause) for multiple single-bit (sbe)
 *                                       or a double-bit (dbe) ECC error, at new addresses, stamped
 *                                       now (realtime us), for nvmlDeviceGetRetiredPages(_v2); N
 *                                       the cause's pages now.  Permanent (restore keeps them); no
 *                                       event, pending_pages unchanged.  A GPU without page
 *                                       retirement (cc 8.0 and later, unsupported=retired_pages):
 *                                       an error
 *   gpm <gpu> name=value ...            GPM activity levels from now on (below): graphics sm
 *                                       sm_occupancy integer tensor dfma hmma imma dram fp64 fp32
 *                                       fp16 in percent, pcie_tx pcie_rx in MiB/s, decimals allowed;
 *                                       others keep theirs (all 0 at first).  A GPU without GPM
 *                                       (cc before 9.0, unsupported=gpm): an error
 *   block <gpu>|* <function>            calls of that entry point (exact exported name) on that
 *                                       GPU hang until released, like a GPU wedged in the driver
 *   release <gpu>|* <function>          undo one block (error if not set); they return normally
 *   release all                         "ok released=N": clear every block
 *   latency <gpu>|* <us>                each call about the GPU ("*": every GPU without its own
 *                                       figure) takes <us> longer, without the global lock, as a
 *                                       driver's call spends time in the kernel; 0 takes it off
 *                                       (a GPU's own: back to the "*" figure); state gives
 *                                       "any_latency=us", per GPU " latency=us" (its own) and
 *                                       "latency_waiting=N": callers in theirs now
 *
 * Blocks.  <function> is any entry point this fake exports but nvmlErrorString
 * (NVML_FUNCS below), e.g. nvmlDeviceGetUUID, nvmlDeviceGetPciInfo_v3; others
 * are an error.  "*" blocks it whatever the GPU, and is the only choice for
 * the calls that take no device (nvmlInit*, nvmlShutdown, nvmlSystemGet*,
 * nvmlDeviceGetCount*, nvmlEventSet*).  A per-device call blocks once its
 * handle checks out (calls that fail at once, uninitialized or a bad or lost
 * handle, fail without blocking); a MIG handle counts as its parent GPU.  A
 * handle lookup (nvmlDeviceGetHandleBy{Index,UUID,Serial,PciBusId}*) blocks
 * for the GPU it finds, so "block 3 nvmlDeviceGetHandleByIndex_v2" hangs the
 * lookup of index 3 (the GPU at index 3 when the command ran); lookups that
 * find nothing block only for "*".  <gpu> is resolved when the command runs
 * and the block stays with that GPU; restore leaves it, a slot reused by add
 * drops it.  A blocked call waits on a condition variable without the global
 * lock: the control thread, other GPUs and the GPU's other functions keep
 * working, and calls entering meanwhile block too.  Released, it starts over
 * as if entering now and returns what that call returns then: its normal
 * result, or NVML_ERROR_UNINITIALIZED if NVML was shut down meanwhile (real
 * NVML leaves a shutdown under a running call undefined; here nvmlShutdown
 * returns normally at once, unless blocked itself), GPU_IS_LOST if the GPU was
 * lost, etc.  state shows "blocked_waiting=N" (callers asleep now),
 * "blocked_calls=N" (calls that have blocked since the library loaded),
 * "any_blocks=fn,...|-" ("*" blocks) and, per GPU, " blocks=fn,..." and
 * " waiting=N" (callers asleep on it).  Blocks need no scenario: "*" ones can
 * be set before the first successful nvmlInit.  A forked child keeps the
 * blocks but none of the parent's blocked callers.
 *
 * Page retirement (GPUs before Ampere, cc < 8.0; later ones remap rows):
 * nvmlDeviceGetRetiredPages(_v2) list a cause's pages ("retire"), in
 * retirement order, with the timestamps for _v2.  *pageCount in is the room
 * in the buffers, which may be NULL only with *pageCount 0 (the size query);
 * too little room, INSUFFICIENT_SIZE with the count needed; a cause but 0
 * and 1, INVALID_ARGUMENT; cc 8.0 and later or unsupported=retired_pages,
 * NOT_SUPPORTED.  nvmlDeviceGetRetiredPagesPendingStatus is separate: it
 * answers pending_pages on every GPU but unsupported=retired_pages ones.
 *
 * GPM (GPU Performance Monitoring; cc 9.0 and later without unsupported=gpm):
 * each GPU holds, per metric, an activity level ("gpm") and its integral
 * over time, brought up to date when a level changes or a sample is taken.
 * nvmlGpmSampleAlloc makes an opaque sample (a heap struct, checked by lookup
 * and magic: others are INVALID_ARGUMENT; nvmlGpmSampleFree releases it);
 * nvmlGpmSampleGet fills it with the GPU's integrals, the time (monotonic ns)
 * and the GPU, nvmlGpmMigSampleGet(gpu, gpuInstanceId, ...) likewise for one
 * GPU instance of a GPU in MIG mode (sharing the GPU's levels).
 * nvmlGpmMetricsGet gives each requested metric's mean level between two
 * samples, (integral2 - integral1) / (t2 - t1): a level changed within the
 * window gives the time-weighted mean.  Modelled metric ids: 1 GRAPHICS_UTIL
 * 2 SM_UTIL 3 SM_OCCUPANCY 4 INTEGER_UTIL 5 ANY_TENSOR_UTIL 6 DFMA_TENSOR_UTIL
 * 7 HMMA_TENSOR_UTIL 9 IMMA_TENSOR_UTIL 10 DRAM_BW_UTIL 11 FP64_UTIL
 * 12 FP32_UTIL 13 FP16_UTIL 20 PCIE_TX_PER_SEC 21 PCIE_RX_PER_SEC; any other
 * id gets NOT_SUPPORTED in its own entry's nvmlReturn.  Return codes:
 * nvmlGpmQueryDeviceSupport and nvmlGpmMetricsGet check their version (1,
 * else ARGUMENT_VERSION_MISMATCH); nvmlGpmMetricsGet reads only numMetrics
 * entries (any NVML_GPM_METRIC_MAX a header has, up to 477; more is
 * INVALID_ARGUMENT), and wants two taken samples of one GPU (and one GPU
 * instance), the second taken later (else INVALID_ARGUMENT).  The SampleGets
 * answer NOT_SUPPORTED on a GPU without GPM, nvmlGpmSampleGet also on a GPU in
 * MIG mode and nvmlGpmMigSampleGet on one not in MIG mode; the latter answers
 * NOT_FOUND for an id no GPU instance has.  The three per-device calls take
 * the GPU's handle (a MIG device's: NOT_SUPPORTED) and answer GPU_IS_LOST,
 * block etc. as every per-device call.
 *
 * A gpu line (scenario or add) may describe a GPU already broken when first
 * probed: lost=0|1 pending_pages=0|1 remap_pending=0|1 remap_failure=0|1
 * recovery_action=N (all 0 by default; like the commands above, without events).
 *
 * Running processes: gpu key procs=<proc>[,<proc>...] (or "-": none, the
 * default), the same list as the procs command; <proc> is
 *   PID[:MIB][:KIND][@GI/CI]
 * PID 1-4294967295, unique per GPU; MIB the GPU memory it uses (omitted:
 * usedGpuMemory is NVML_VALUE_NOT_AVAILABLE); KIND compute (default), graphics
 * or mps, or several joined by '+' (compute+graphics: nvidia-smi's "C+G"),
 * choosing which of nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses
 * list it; @GI/CI puts it on the GPU's MIG device with those ids (it must exist:
 * on a scenario gpu line, made by a later mig line; never on an add line).
 * A GPU handle lists all its processes (gpuInstanceId/computeInstanceId
 * 0xFFFFFFFF for those not on a MIG device), a MIG handle the ones on it, as
 * NVML does for a privileged caller; unsupported=processes makes all nine
 * queries NOT_SUPPORTED.  The state reply shows " procs=<list>".
 *
 * Compute mode (nvmlDevice{Get,Set}ComputeMode, nvmlComputeMode_t: DEFAULT 0,
 * EXCLUSIVE_THREAD 1, PROHIBITED 2, EXCLUSIVE_PROCESS 3) is driver state, not
 * process state: RM keeps the rule "so that it persists even after the last
 * client disconnects" (subdeviceCtrlCmdGpuSetComputeModeRules in the open GPU
 * kernel modules), and on Linux it goes back to DEFAULT only at a reboot
 * (nvml.h).  So each successful set is written at once to the state file
 * $FAKE_NVML_STATE_DIR/fakenvml.state (unset: the directory of
 * FAKE_NVML_CONTROL; set but empty, or neither set: no file, the modes live in
 * this process), one line "<uuid> compute_mode=N" per GPU whose mode was set,
 * rewritten whole and renamed into place under a lock on fakenvml.state.lock,
 * and every use reads it again.  All processes of one simulated node (one
 * directory: the daemon, a restart of it after a SIGKILL, a CLI next to it)
 * thus see one mode per GPU, and another node its own.  A GPU without a line
 * has its gpu line's compute_mode=N (0-3 or a name, default 0); the key is the
 * UUID, so a GPU removed and added again keeps its mode; deleting the file is
 * a driver reload.  The fake has no GPU reset.  fakenvml_library.persisted_compute_modes
 * reads the file.
 *
 * nvmlDeviceSetComputeMode, past the handle checks (UNINITIALIZED,
 * INVALID_ARGUMENT, GPU_IS_LOST, then blocks), returns INVALID_ARGUMENT for a
 * mode but 0, 2 or 3 (EXCLUSIVE_THREAD's support is removed, nvml.h;
 * nvidia-smi -c 1 sets 3 instead), NO_PERMISSION unless geteuid() is 0
 * ("Requires root/admin permissions"), NOT_SUPPORTED for a GPU in MIG mode (RM
 * refuses while MIG is enabled; nvidia-smi says "not supported on a
 * MIG-enabled device") or with unsupported=compute_mode (the Get too), UNKNOWN
 * if the state file cannot be written, else SUCCESS whatever runs on the GPU
 * (RM only records the rule, which binds contexts made later).  A MIG device
 * handle gets NOT_SUPPORTED from both, as from the R550 driver this fake
 * reports; a GPU in MIG mode reads its mode.  (Later nvml.h versions give each
 * MIG device a mode of its own, "If MIG is enabled on a GPU, device must be
 * MIG device handle"; not modelled.)
 *
 * The mode limits new process lists, of the procs command (checked against the
 * mode now) and of gpu lines (against their own compute_mode=, not the state
 * file), outside MIG mode (RM makes no compute-mode reservations then): in
 * EXCLUSIVE_PROCESS (and EXCLUSIVE_THREAD) a GPU has one context, so at most
 * one process of KIND compute (under MPS the server; its clients are KIND mps,
 * listed by nvmlDeviceGetMPSComputeRunningProcesses); in PROHIBITED none, so
 * no process of KIND compute or mps.  A list breaking the rule is an error
 * naming it; a mode set over such a list leaves it (contexts that were there
 * before).
 *
 * MIG: gpu key mig=0|1 (current mode), and scenario lines
 *   mig <gpu-index> <profile> [gi=N] [ci=N] [uuid=MIG-...]
 * each add one MIG device (one GPU instance holding one compute instance) to
 * the GPU defined above with that index, in enumeration order.  Profiles (H100
 * 80GB): 1g.10gb 1g.10gb+me 1g.20gb 2g.20gb 3g.40gb 4g.40gb 7g.80gb; at most
 * 7 slices per GPU, gi unique per GPU (0-14, default the lowest free from 1),
 * ci 0-7 (default 0).  UUIDs default to MIG-<hash of parent uuid, gi, ci>
 * (fakenvml_devices.mig_uuid in Python computes the same).  MIG handles are pointers
 * into a separate static array; most per-device queries answer NOT_SUPPORTED
 * for them; UUID, name, memory info, attributes, gi/ci ids, parent lookup and
 * IsMigDeviceHandle work; a lost parent makes them GPU_IS_LOST; a removed MIG
 * device's handle gives INVALID_ARGUMENT (slots are reused round-robin, so a
 * very old stale handle may name a newer MIG device, as NVML allows).
 *
 * One global mutex guards all state: the library is tiny and the contention
 * (a daemon plus one control thread) is negligible.  The per-function call
 * counters are atomics instead, so that counting never touches the lock.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- NVML ABI (values and layouts copied from nvml.h / pynvml) ---------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999
};

enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 };

/* nvmlComputeMode_t; EXCLUSIVE_THREAD is "Support Removed" in nvml.h. */
enum {
    NVML_COMPUTEMODE_DEFAULT = 0,
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1,
    NVML_COMPUTEMODE_PROHIBITED = 2,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3,
    NVML_COMPUTEMODE_COUNT
};

enum {
    NVML_TOPOLOGY_INTERNAL = 0,
    NVML_TOPOLOGY_SINGLE = 10,
    NVML_TOPOLOGY_MULTIPLE = 20,
    NVML_TOPOLOGY_HOSTBRIDGE = 30,
    NVML_TOPOLOGY_NODE = 40,
    NVML_TOPOLOGY_SYSTEM = 50
};

#define EV_SBE 0x1ULL
#define EV_DBE 0x2ULL
#define EV_XID 0x8ULL
#define EV_MIG_CONFIG 0x100ULL
#define EV_FATAL_POISON 0x2000ULL
#define EV_GPU_UNAVAILABLE 0x4000ULL
#define EV_RECOVERY_ACTION 0x8000ULL
#define EV_DEFAULT \
    (EV_XID | EV_DBE | EV_SBE | EV_MIG_CONFIG | EV_GPU_UNAVAILABLE | EV_FATAL_POISON | EV_RECOVERY_ACTION)
#define ID_ANY 0xFFFFFFFFu   /* NVML_GPU_INSTANCE_ID_ANY / NVML_COMPUTE_INSTANCE_ID_ANY */
#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ULL)   /* NVML_VALUE_NOT_AVAILABLE (-1) in a 64-bit field */

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_FI_DEV_MEMORY_TEMP 82   /* the HBM's temperature, C */
/* NVLink data KiB since the GPU's last reset: TX, RX, then with the protocol's overhead, TX and RX;
 * scopeId a link, or NVLINK_ALL_LINKS for their sum */
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138
#define NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX 141
#define NVLINK_ALL_LINKS 0xFFFFFFFFu
/* The ns a performance policy held the clocks down (as nvmlDeviceGetViolationStatus's violationTime):
 * power, thermal, sync boost, board limit, low utilization, reliability, total app clocks; then 81, the
 * total below base clocks, not given here */
#define NVML_FI_DEV_PERF_POLICY_POWER 74
#define NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS 80
/* Figures that also have a call of their own, and give what it gives: ECC totals (single-bit volatile,
 * double-bit volatile, single-bit aggregate, double-bit aggregate: nvmlDeviceGetTotalEccErrors), retired
 * pages (multiple single-bit, double-bit, pending), total energy (mJ), PCIe replays, remapped rows
 * (correctable, uncorrectable, pending, failure) */
#define NVML_FI_DEV_ECC_SBE_VOL_TOTAL 3
#define NVML_FI_DEV_ECC_DBE_AGG_TOTAL 6
#define NVML_FI_DEV_RETIRED_SBE 29
#define NVML_FI_DEV_RETIRED_DBE 30
#define NVML_FI_DEV_RETIRED_PENDING 31
#define NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION 83
#define NVML_FI_DEV_PCIE_REPLAY_COUNTER 94
#define NVML_FI_DEV_REMAPPED_COR 142
#define NVML_FI_DEV_REMAPPED_FAILURE 145
#define VIOL_N 7   /* policies 0-5, and 10 (any of them) */
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_OK 0
#define NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED 3
#define NVML_P2P_STATUS_NOT_SUPPORTED 5
#define NVML_NVLINK_DEVICE_TYPE_GPU 0
#define NVML_NVLINK_DEVICE_TYPE_SWITCH 2
#define NVML_BRAND_NVIDIA 14
#define NVML_MEMORY_V2 0x02000028u

#define NVLINK_MAX 18     /* links per GPU this fake models (NVML_NVLINK_MAX_LINKS of older headers) */
#define MAX_GPUS 64       /* slots; never reused, so removed GPUs keep stale handles well defined */
#define QCAP 4096         /* events queued per event set before the oldest is dropped */
#define MIG_PER_GPU 7     /* MIG devices (= slices) per GPU at most */
#define MIG_SLOTS (MAX_GPUS * MIG_PER_GPU)
#define MIG_MAX_GI 14     /* GPU instance ids 0..14 (15 per GPU, as in nvidia-caps) */
#define MIG_MAX_CI 7      /* compute instance ids 0..7 */
#define PROCS_MAX 512     /* running processes per GPU */
#define SAMPLES_MAX 1024  /* process utilization samples kept per GPU, oldest dropped */
#define RETIRED_MAX 256   /* retired pages kept per GPU and cause ("retire": more is an error) */

typedef struct fake_dev *nvmlDevice_t;
typedef struct fake_evset *nvmlEventSet_t;

/* Current nvmlPciInfo_t (used by _v3 and NvLinkRemotePciInfo_v2). */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

/* Legacy layout used by nvmlDeviceGetPciInfo and _v2. */
typedef struct {
    char busId[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfoLegacy_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/*
 * Running-process records (nvml.h).  nvmlProcessInfo_v1_t is what the
 * unversioned nvmlDevice*RunningProcesses take; _v2 and _v3 both take the
 * four-field struct (nvml.h names it nvmlProcessInfo_v2_t and
 * nvmlProcessInfo_t; pynvml's c_nvmlProcessInfo_v2_t/_v3_t).  The R535.54
 * drivers briefly gave _v3 a fifth field (usedGpuCcProtectedMemory); later
 * drivers went back to four and moved it to nvmlProcessDetail_v1_t.
 */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;   /* NVML_VALUE_NOT_AVAILABLE when unknown */
    unsigned int gpuInstanceId;         /* 0xFFFFFFFF: not on a MIG device */
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* nvmlPageRetirementCause_t */
enum {
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0,
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1,
    NVML_PAGE_RETIREMENT_CAUSE_COUNT
};

/*
 * GPM (GPU Performance Monitoring).  A sample is opaque to the caller
 * (nvml.h: typedef struct nvmlGpmSample_st *nvmlGpmSample_t); here it is a
 * struct fake_gpm_sample (below).  NVML_GPM_METRIC_MAX grew between header
 * versions (98 in the first ones, 477 in later ones), and with it
 * nvmlGpmMetricsGet_t: only the first numMetrics entries are read or
 * written, so a caller built with any of them works.
 */
#define NVML_GPM_SUPPORT_VERSION 1
#define NVML_GPM_METRICS_GET_VERSION 1
#define NVML_GPM_METRIC_MAX 477
typedef struct fake_gpm_sample *nvmlGpmSample_t;

typedef struct {
    unsigned int version;               /* NVML_GPM_SUPPORT_VERSION */
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

typedef struct {
    unsigned int metricId;              /* nvmlGpmMetricId_t, set by the caller */
    nvmlReturn_t nvmlReturn;            /* this metric's own result */
    double value;
    struct {
        char *shortName;
        char *longName;
        char *unit;
    } metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version;               /* NVML_GPM_METRICS_GET_VERSION */
    unsigned int numMetrics;            /* entries of metrics[] to compute */
    nvmlGpmSample_t sample1;            /* the earlier sample */
    nvmlGpmSample_t sample2;            /* the later one, of the same device (and GPU instance) */
    nvmlGpmMetric_t metrics[NVML_GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;

/* ---- simulated state ------------------------------------------------------ */

/* Bits of the scenario's unsupported= list. */
enum {
    U_NUMA = 1 << 0, U_CC = 1 << 1, U_MEMORY = 1 << 2, U_MINOR = 1 << 3,
    U_SERIAL = 1 << 4, U_NAME = 1 << 5, U_EVENTS = 1 << 6, U_TOPOLOGY = 1 << 7,
    U_NVLINK = 1 << 8, U_RETIRED_PAGES = 1 << 9, U_REMAPPED_ROWS = 1 << 10,
    U_MIG = 1 << 11, U_PERSISTENCE = 1 << 12, U_RECOVERY_ACTION = 1 << 13, U_PROCESSES = 1 << 14,
    U_COMPUTE_MODE = 1 << 15, U_ECC = 1 << 16, U_TELEMETRY = 1 << 17, U_GPM = 1 << 18,
    U_MEMORY_TEMP = 1 << 19
};
static const struct { const char *name; unsigned bit; } unsupported_names[] = {
    {"numa", U_NUMA}, {"cc", U_CC}, {"memory", U_MEMORY}, {"minor", U_MINOR},
    {"serial", U_SERIAL}, {"name", U_NAME}, {"events", U_EVENTS}, {"topology", U_TOPOLOGY},
    {"nvlink", U_NVLINK}, {"retired_pages", U_RETIRED_PAGES}, {"remapped_rows", U_REMAPPED_ROWS},
    {"mig", U_MIG}, {"persistence", U_PERSISTENCE}, {"recovery_action", U_RECOVERY_ACTION},
    {"processes", U_PROCESSES}, {"compute_mode", U_COMPUTE_MODE}, {"ecc", U_ECC},
    {"telemetry", U_TELEMETRY}, {"gpm", U_GPM}, {"memory_temp", U_MEMORY_TEMP},
};

/* Which running-process queries list a process (procs= KIND). */
enum { K_COMPUTE = 1, K_GRAPHICS = 2, K_MPS = 4 };
static const struct { const char *name; unsigned bit; } proc_kinds[] = {
    {"compute", K_COMPUTE}, {"graphics", K_GRAPHICS}, {"mps", K_MPS},
};

/*
 * The GPM metrics this fake models (nvmlGpmMetricId_t), each an activity
 * level of the GPU: percent for the *_UTIL ones, MiB/s for the *_PER_SEC
 * ones.  name: in the "gpm" command; max: the highest level it takes;
 * the last three are the metricInfo strings nvmlGpmMetricsGet gives.
 */
#define GPM_PCIE_MAX 1000000.0   /* MiB/s, well over any PCIe link */
static const struct gpm_metric {
    unsigned id;
    const char *name;
    double max;
    const char *short_name, *long_name, *unit;
} gpm_metrics[] = {
    {1, "graphics", 100, "graphics_util", "Graphics or compute engine activity", "%"},
    {2, "sm", 100, "sm_util", "SMs busy", "%"},
    {3, "sm_occupancy", 100, "sm_occupancy", "Warps resident vs the theoretical maximum", "%"},
    {4, "integer", 100, "integer_util", "SM integer pipe activity", "%"},
    {5, "tensor", 100, "any_tensor_util", "SM tensor pipe activity, any kind", "%"},
    {6, "dfma", 100, "dfma_tensor_util", "SM DFMA tensor pipe activity", "%"},
    {7, "hmma", 100, "hmma_tensor_util", "SM HMMA tensor pipe activity", "%"},
    {9, "imma", 100, "imma_tensor_util", "SM IMMA tensor pipe activity", "%"},
    {10, "dram", 100, "dram_bw_util", "DRAM bandwidth used vs the theoretical maximum", "%"},
    {11, "fp64", 100, "fp64_util", "SM non-tensor FP64 pipe activity", "%"},
    {12, "fp32", 100, "fp32_util", "SM non-tensor FP32 pipe activity", "%"},
    {13, "fp16", 100, "fp16_util", "SM non-tensor FP16 pipe activity", "%"},
    {20, "pcie_tx", GPM_PCIE_MAX, "pcie_tx_per_sec", "PCIe traffic from the GPU", "MiB/s"},
    {21, "pcie_rx", GPM_PCIE_MAX, "pcie_rx_per_sec", "PCIe traffic to the GPU", "MiB/s"},
};
#define GPM_N ((int)(sizeof gpm_metrics / sizeof gpm_metrics[0]))

/* nvmlProcessUtilizationSample_t */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;   /* CPU timestamp in microseconds */
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long referenceTime;   /* when it was read, us */
    unsigned long long violationTime;   /* ns the policy held the clocks down */
} nvmlViolationTime_t;

struct fake_proc {
    unsigned pid;
    unsigned kinds;             /* K_* bits */
    unsigned gi, ci;            /* its MIG device's ids, or ID_ANY */
    unsigned long long mem;     /* bytes, or NVML_VALUE_NOT_AVAILABLE_ULL */
};

struct fake_dev {
    /* identity, from the scenario or an "add" command */
    char uuid[96];
    char name[96];
    char serial[32];
    unsigned domain, bus, devno, func;
    unsigned minor;
    int numa;
    unsigned long long memory_mib;
    int cc_major, cc_minor;
    unsigned pci_device_id, pci_subsystem_id;
    unsigned unsupported;
    unsigned long long events;
    /* lifecycle */
    int visible;        /* enumerated in the current init cycle */
    int ever_visible;   /* a handle to it may exist */
    int removed;        /* "remove": lost now, gone from the next 0->1 init */
    int lost;           /* "lose": every call returns GPU_IS_LOST */
    /* health probes */
    unsigned pending_pages, remap_pending, remap_failure, corr_rows, unc_rows;
    unsigned recovery_action;
    /* ECC error counts by nvmlMemoryErrorType_t (corrected, uncorrected) and nvmlEccCounterType_t
     * (volatile: since the driver loaded or the GPU was reset; aggregate: the GPU's whole life) */
    unsigned long long ecc[2][2];
    /* telemetry ("telemetry"): what the device figures answer */
    unsigned util_gpu, util_mem, util_enc, util_dec;    /* percent */
    unsigned temp_c, mem_temp_c, power_mw, sm_mhz, mem_mhz, pcie_replays;
    unsigned long long throttle;        /* nvmlClocksEventReasons bits */
    /* the ns each performance policy (nvmlPerfPolicyType_t 0-5, then any of them) has held the clocks
     * down since the driver loaded, up to levels_since: each grows while throttle has its reasons' bits */
    unsigned long long viol_ns[VIOL_N];
    unsigned long long reserved_mib;    /* framebuffer the driver keeps: used before any process */
    unsigned long long energy_mj;       /* at energy_since; grows at power_mw from then */
    struct timespec energy_since;
    /* process utilization samples ("samples"), oldest first, a ring */
    int nsamples, sample_head;
    unsigned long long last_sample_us;
    /* retired pages ("retire"; before Ampere), by nvmlPageRetirementCause_t, in retirement order */
    unsigned nretired[NVML_PAGE_RETIREMENT_CAUSE_COUNT];
    unsigned long long retired_addr[NVML_PAGE_RETIREMENT_CAUSE_COUNT][RETIRED_MAX];
    unsigned long long retired_us[NVML_PAGE_RETIREMENT_CAUSE_COUNT][RETIRED_MAX];   /* realtime */
    unsigned long long retired_next;    /* pages retired so far, both causes: the next address */
    /* GPM ("gpm"; Hopper and later): per gpm_metrics entry the level now and its integral
     * over time (level x seconds) up to levels_since */
    double gpm_level[GPM_N], gpm_integral[GPM_N];
    /* NVLink traffic ("telemetry nvlink_tx= nvlink_rx=", MiB/s): the data KiB sent and received since
     * the GPU was last reset, up to levels_since, growing at the rates from then */
    double nvlink_kib[2], nvlink_mibps[2];
    /* when the figures that grow at a level (GPM's integrals, NVLink's counts, the violation times) were
     * last brought up to date (CLOCK_MONOTONIC ns): levels_advance */
    unsigned long long levels_since;
    /* MIG */
    int mig_mode;
    int nmig;
    int mig[MIG_PER_GPU];   /* g_migs indices, in MIG device index order */
    /* running processes ("procs") */
    int nprocs;
    struct fake_proc procs[PROCS_MAX];
    /* compute mode from the gpu line: the GPU's until the driver state has one (cm_of) */
    int compute_mode;
};

/* H100 80GB MIG profiles; a MIG device is one GPU instance with one compute instance. */
static const struct mig_profile {
    const char *name;
    unsigned slices, memory_mb, sms, copy, dec, jpeg, ofa;
} mig_profiles[] = {
    {"1g.10gb", 1, 9856, 16, 1, 1, 1, 0},   {"1g.10gb+me", 1, 9856, 16, 1, 1, 1, 1},
    {"1g.20gb", 1, 19968, 16, 1, 1, 1, 0},  {"2g.20gb", 2, 19968, 32, 2, 2, 2, 0},
    {"3g.40gb", 3, 40192, 48, 3, 3, 3, 0},  {"4g.40gb", 4, 40192, 64, 4, 4, 4, 0},
    {"7g.80gb", 7, 80896, 132, 7, 7, 7, 1},
};
#define N_PROFILES ((int)(sizeof mig_profiles / sizeof mig_profiles[0]))

struct fake_mig {
    int used;           /* part of its parent's current layout */
    int parent;         /* g_devs slot */
    int profile;        /* mig_profiles index */
    unsigned gi, ci;
    char uuid[96];
};

struct ev {
    int slot;
    unsigned long long type, data;
    unsigned gi, ci;
};

struct fake_evset {
    struct fake_evset *next;
    int waiters;        /* nvmlEventSetWait calls in progress on it */
    pthread_cond_t cond;
    unsigned long long reg[MAX_GPUS];   /* registered event mask per slot */
    unsigned head, count;
    unsigned long long dropped;
    struct ev q[QCAP];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_dev g_devs[MAX_GPUS];
/* Each slot's process utilization samples: a ring of SAMPLES_MAX from sample_head (fake_dev). */
static nvmlProcessUtilizationSample_t g_samples[MAX_GPUS][SAMPLES_MAX];
static int g_nslots;
static int g_order[MAX_GPUS];   /* slots enumerated in this init cycle, by index */
static int g_count;
static unsigned char g_nvlink[MAX_GPUS][MAX_GPUS];
static unsigned char g_pcie[MAX_GPUS][MAX_GPUS];
static struct fake_mig g_migs[MIG_SLOTS];
static int g_mig_next;   /* round-robin allocation cursor: stale handles stay stale for long */
static int g_loaded;
static int g_refcount;
/*
 * As the real driver does (seen on 580.159): the last nvmlShutdown, and the
 * nvmlEventSetFree of a set being waited on, wait until every
 * nvmlEventSetWait in progress has returned (an event or its timeout); the
 * shutdown does not cut a wait short.  A wait that starts while such a
 * shutdown waits waits for it too, then fails UNINITIALIZED.
 */
static int g_waiting;                 /* nvmlEventSetWait calls in progress, all sets */
static int g_shutting_down;           /* a last nvmlShutdown waits for them */
static unsigned long long g_shutdown_waits;   /* shutdowns and frees that had to wait, ever */
static pthread_cond_t g_waits_done = PTHREAD_COND_INITIALIZER;
static nvmlReturn_t g_init_error;
static char g_driver[80] = "550.54.15";
static char g_nvml[80] = "12.550.54.15";
static int g_cuda = 12040;
static struct fake_evset *g_sets;

/*
 * A GPM sample (nvmlGpmSample_t): the time it was taken and the GPU's GPM
 * integrals then.  Allocated by nvmlGpmSampleAlloc and listed in
 * g_gpm_samples until nvmlGpmSampleFree, so that a pointer is checked by
 * looking it up (a foreign one is never read) and then by its magic.  They
 * belong to the caller: an nvmlShutdown leaves them.
 */
#define GPM_MAGIC 0x47504D53u   /* "GPMS" */
struct fake_gpm_sample {
    unsigned magic;                     /* GPM_MAGIC while allocated */
    struct fake_gpm_sample *next;       /* g_gpm_samples */
    int taken;                          /* filled by nvmlGpm(Mig)SampleGet */
    int slot;                           /* the GPU it was taken on */
    char uuid[96];                      /* which GPU that was (add reuses the slots of GPUs gone) */
    unsigned gi;                        /* the GPU instance of a MIG sample; ID_ANY: the whole GPU */
    unsigned long long t_ns;            /* CLOCK_MONOTONIC when taken */
    double integral[GPM_N];             /* the GPU's gpm_integral then */
};
static struct fake_gpm_sample *g_gpm_samples;
static nvmlReturn_t g_wait_error;   /* "wait_error": returned by the next g_wait_left waits */
static long g_wait_left;            /* -1: every wait until cleared */

/*
 * Calls per exported function (all but nvmlErrorString, which a binding may
 * call for any message), so that tests can see what a client does while idle.
 * Every exported function starts with COUNT(itself); wrappers call static
 * helpers, never each other, so that one client call counts once.
 *
 * The second column says what a "block" (see block_point) can name it by:
 * SYS takes no device ("*" only), LOOKUP finds a device (the GPU it finds, or
 * "*"), DEV takes a device handle (its GPU, or "*" for any GPU).
 */
#define NVML_FUNCS(X)                                                                                    \
    X(nvmlInit, SYS) X(nvmlInit_v2, SYS) X(nvmlInitWithFlags, SYS) X(nvmlShutdown, SYS)                  \
    X(nvmlSystemGetDriverVersion, SYS) X(nvmlSystemGetNVMLVersion, SYS)                                  \
    X(nvmlSystemGetCudaDriverVersion, SYS) X(nvmlSystemGetCudaDriverVersion_v2, SYS)                     \
    X(nvmlDeviceGetCount, SYS) X(nvmlDeviceGetCount_v2, SYS) X(nvmlDeviceGetHandleByIndex, LOOKUP)       \
    X(nvmlDeviceGetHandleByIndex_v2, LOOKUP) X(nvmlDeviceGetHandleByUUID, LOOKUP)                        \
    X(nvmlDeviceGetHandleBySerial, LOOKUP) X(nvmlDeviceGetHandleByPciBusId, LOOKUP)                      \
    X(nvmlDeviceGetHandleByPciBusId_v2, LOOKUP) X(nvmlDeviceGetIndex, DEV) X(nvmlDeviceGetUUID, DEV)     \
    X(nvmlDeviceGetName, DEV) X(nvmlDeviceGetSerial, DEV) X(nvmlDeviceGetMinorNumber, DEV)               \
    X(nvmlDeviceGetBrand, DEV) X(nvmlDeviceGetArchitecture, DEV) X(nvmlDeviceGetPersistenceMode, DEV)    \
    X(nvmlDeviceGetComputeMode, DEV) X(nvmlDeviceGetPciInfo, DEV) X(nvmlDeviceGetPciInfo_v2, DEV)        \
    X(nvmlDeviceGetPciInfo_v3, DEV) X(nvmlDeviceGetMemoryInfo, DEV) X(nvmlDeviceGetMemoryInfo_v2, DEV)   \
    X(nvmlDeviceGetCudaComputeCapability, DEV) X(nvmlDeviceGetNumaNodeId, DEV)                           \
    X(nvmlDeviceGetMigMode, DEV) X(nvmlDeviceGetMaxMigDeviceCount, DEV)                                  \
    X(nvmlDeviceIsMigDeviceHandle, DEV) X(nvmlDeviceGetMigDeviceHandleByIndex, DEV)                      \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, DEV) X(nvmlDeviceGetGpuInstanceId, DEV)              \
    X(nvmlDeviceGetComputeInstanceId, DEV) X(nvmlDeviceGetAttributes, DEV)                               \
    X(nvmlDeviceGetAttributes_v2, DEV) X(nvmlDeviceGetTopologyCommonAncestor, DEV)                       \
    X(nvmlDeviceGetP2PStatus, DEV) X(nvmlDeviceGetNvLinkState, DEV) X(nvmlDeviceGetNvLinkVersion, DEV)   \
    X(nvmlDeviceGetNvLinkRemoteDeviceType, DEV) X(nvmlDeviceGetNvLinkRemotePciInfo, DEV)                 \
    X(nvmlDeviceGetNvLinkRemotePciInfo_v2, DEV) X(nvmlDeviceGetRetiredPagesPendingStatus, DEV)           \
    X(nvmlDeviceGetRemappedRows, DEV) X(nvmlDeviceGetFieldValues, DEV)                                   \
    X(nvmlDeviceGetTotalEccErrors, DEV) X(nvmlDeviceGetUtilizationRates, DEV)                            \
    X(nvmlDeviceGetTemperature, DEV) X(nvmlDeviceGetPowerUsage, DEV)                                     \
    X(nvmlDeviceGetTotalEnergyConsumption, DEV) X(nvmlDeviceGetClockInfo, DEV)                           \
    X(nvmlDeviceGetCurrentClocksEventReasons, DEV) X(nvmlDeviceGetCurrentClocksThrottleReasons, DEV)     \
    X(nvmlDeviceGetPcieReplayCounter, DEV) X(nvmlDeviceGetProcessUtilization, DEV)                       \
    X(nvmlDeviceGetEncoderUtilization, DEV) X(nvmlDeviceGetDecoderUtilization, DEV)                     \
    X(nvmlDeviceGetViolationStatus, DEV)                                                                 \
    X(nvmlDeviceGetSupportedEventTypes, DEV) X(nvmlEventSetCreate, SYS) X(nvmlDeviceRegisterEvents, DEV) \
    X(nvmlEventSetFree, SYS) X(nvmlEventSetWait, SYS) X(nvmlEventSetWait_v2, SYS)                        \
    X(nvmlDeviceGetComputeRunningProcesses, DEV) X(nvmlDeviceGetComputeRunningProcesses_v2, DEV)         \
    X(nvmlDeviceGetComputeRunningProcesses_v3, DEV) X(nvmlDeviceGetGraphicsRunningProcesses, DEV)        \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, DEV) X(nvmlDeviceGetGraphicsRunningProcesses_v3, DEV)    \
    X(nvmlDeviceGetMPSComputeRunningProcesses, DEV) X(nvmlDeviceGetMPSComputeRunningProcesses_v2, DEV)   \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3, DEV) X(nvmlDeviceSetComputeMode, DEV)                  \
    X(nvmlDeviceGetRetiredPages, DEV) X(nvmlDeviceGetRetiredPages_v2, DEV)                               \
    X(nvmlGpmQueryDeviceSupport, DEV) X(nvmlGpmSampleAlloc, SYS) X(nvmlGpmSampleFree, SYS)               \
    X(nvmlGpmSampleGet, DEV) X(nvmlGpmMigSampleGet, DEV) X(nvmlGpmMetricsGet, SYS)

enum fn_kind { FK_SYS, FK_LOOKUP, FK_DEV };
#define FN_ENUM(f, k) FN_##f,
#define FN_NAME(f, k) #f,
#define FN_KIND(f, k) FK_##k,
enum { NVML_FUNCS(FN_ENUM) N_FUNCS };
static const char *const fn_names[N_FUNCS] = {NVML_FUNCS(FN_NAME)};
static const unsigned char fn_kinds[N_FUNCS] = {NVML_FUNCS(FN_KIND)};
static atomic_ullong g_calls[N_FUNCS];

/*
 * The entry point this thread is in, for block_point: the begin helpers are
 * shared by many entry points (and wrappers reach them through static
 * helpers), so COUNT, which every entry point starts with, records it rather
 * than every helper taking one more argument.  -1: not in an entry point.
 */
static _Thread_local int t_fn = -1;
static _Thread_local int t_slept;   /* this call has taken its latency (below) */

#define COUNT(f) (t_fn = FN_##f, t_slept = 0, atomic_fetch_add_explicit(&g_calls[FN_##f], 1, memory_order_relaxed))

static nvmlReturn_t done(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/*
 * Blocks ("block <gpu> <function>"): a hung driver, where a call on a wedged
 * GPU never returns.  g_blocks[slot][fn] is set per GPU slot, row ANY_GPU for
 * "*" (any GPU, and the only row the SYS functions look at).  Guarded by
 * g_lock like all state.  A blocked caller sleeps on g_block_cond, which gives
 * g_lock up for the wait: the control thread, the other GPUs and the GPU's
 * other functions carry on, and "release" can reach it.
 */
#define ANY_GPU MAX_GPUS
static unsigned char g_blocks[MAX_GPUS + 1][N_FUNCS];
static pthread_cond_t g_block_cond = PTHREAD_COND_INITIALIZER;
static int g_block_waiters[MAX_GPUS + 1];   /* callers asleep now, per GPU slot (ANY_GPU: no GPU) */
static unsigned long long g_block_calls;    /* calls that have blocked, since the library loaded */

/*
 * Latency ("latency <gpu>|* <us>"): the time a driver's call spends in the
 * kernel, which a fake answering from memory does not.  Each call about the
 * GPU takes it once, at its hang point, without g_lock: other GPUs' calls,
 * and other threads' calls on this GPU, run meanwhile.  Row ANY_GPU: every GPU
 * without a figure of its own.
 */
static unsigned g_latency_us[MAX_GPUS + 1];
static int g_latency_waiting;   /* callers in their latency now */

static int latency_point(int slot)
{
    unsigned us = g_latency_us[slot] ? g_latency_us[slot] : g_latency_us[ANY_GPU];
    struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
    if (!us || t_slept)
        return 0;
    t_slept = 1;
    g_latency_waiting++;
    pthread_mutex_unlock(&g_lock);
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
    pthread_mutex_lock(&g_lock);
    g_latency_waiting--;
    return 1;
}

static int block_matches(int slot)
{
    return t_fn >= 0 && (g_blocks[ANY_GPU][t_fn] || (slot >= 0 && g_blocks[slot][t_fn]));
}

/*
 * The hang point: every entry point calls it (through the begin helpers)
 * with g_lock held once it knows which GPU slot the call is about (-1: none),
 * after the checks that fail a call at once (uninitialized, bad or lost
 * handle), as a driver validates before it talks to the GPU.  A MIG handle
 * counts as its parent GPU.  Returns 0 at once when no block matches.
 * Otherwise sleeps until none does and returns 1, g_lock held again: anything
 * may have happened meanwhile (nvmlShutdown, a lost GPU, a new MIG layout,
 * even a new GPU in the slot), so the caller validates again from the start,
 * as a call entering now would, and may block again.
 */
static int block_point(int slot)
{
    int row = slot >= 0 ? slot : ANY_GPU;
    if (slot >= 0 && latency_point(slot))
        return 1;
    if (!block_matches(slot))
        return 0;
    g_block_calls++;
    g_block_waiters[row]++;
    while (block_matches(slot))
        pthread_cond_wait(&g_block_cond, &g_lock);
    g_block_waiters[row]--;
    return 1;
}

/* For the lookups, which start over from sys_begin: it waited, so give g_lock back first. */
static int lookup_blocked(int slot)
{
    if (!block_point(slot))
        return 0;
    pthread_mutex_unlock(&g_lock);
    return 1;
}

/* ---- small parsing helpers ------------------------------------------------ */

static int parse_ull(const char *s, int base, unsigned long long max, unsigned long long *out)
{
    char *end;
    unsigned long long v;
    if (!s || !*s || *s == '-' || *s == '+')
        return -1;
    errno = 0;
    v = strtoull(s, &end, base);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v;
    if (!s || !*s)
        return -1;
    errno = 0;
    v = strtol(s, &end, 0);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int parse_hex_part(const char *s, size_t n, unsigned long max, unsigned *out)
{
    char buf[16], *end;
    unsigned long v;
    if (n == 0 || n >= sizeof buf)
        return -1;
    memcpy(buf, s, n);
    buf[n] = 0;
    errno = 0;
    v = strtoul(buf, &end, 16);
    if (errno || *end || v > max || buf[0] == '-' || buf[0] == '+')
        return -1;
    *out = (unsigned)v;
    return 0;
}

/* Accepts [DDDD[DDDD]:]BB:DD[.F], hex, any case, as NVML's bus-id lookups do. */
static int parse_busid(const char *s, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn)
{
    const char *c1, *c2, *dot, *p = s, *devp;
    size_t devlen;
    if (!s)
        return -1;
    c1 = strchr(s, ':');
    if (!c1)
        return -1;
    c2 = strchr(c1 + 1, ':');
    if (c2) {
        if (strchr(c2 + 1, ':') || parse_hex_part(s, (size_t)(c1 - s), 0xFFFF, dom))
            return -1;
        p = c1 + 1;
    } else {
        *dom = 0;
        c2 = c1;
    }
    if (parse_hex_part(p, (size_t)(c2 - p), 0xFF, bus))
        return -1;
    devp = c2 + 1;
    dot = strchr(devp, '.');
    devlen = dot ? (size_t)(dot - devp) : strlen(devp);
    if (parse_hex_part(devp, devlen, 0x1F, dev))
        return -1;
    *fn = 0;
    if (dot && parse_hex_part(dot + 1, strlen(dot + 1), 7, fn))
        return -1;
    return 0;
}

static int parse_level(const char *s, int *out)
{
    static const struct { const char *n; int v; } lv[] = {
        {"INTERNAL", 0}, {"SINGLE", 10}, {"MULTIPLE", 20}, {"HOSTBRIDGE", 30},
        {"NODE", 40}, {"CPU", 40}, {"SYSTEM", 50},
    };
    long v;
    size_t i;
    for (i = 0; i < sizeof lv / sizeof lv[0]; i++)
        if (!strcasecmp(s, lv[i].n)) {
            *out = lv[i].v;
            return 0;
        }
    if (parse_int(s, 0, 50, &v) == 0 && v % 10 == 0) {
        *out = (int)v;
        return 0;
    }
    return -1;
}

/* nvidia-smi's names, by nvmlComputeMode_t value. */
static const char *const cm_names[NVML_COMPUTEMODE_COUNT] = {
    "DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS",
};

/* A compute mode, 0-3 or its name (any case), as nvidia-smi -c takes it. */
static int parse_cm(const char *s, int *out)
{
    long v;
    int i;
    for (i = 0; i < NVML_COMPUTEMODE_COUNT; i++)
        if (!strcasecmp(s, cm_names[i])) {
            *out = i;
            return 0;
        }
    if (parse_int(s, 0, NVML_COMPUTEMODE_COUNT - 1, &v))
        return -1;
    *out = (int)v;
    return 0;
}

/*
 * Splits a line in place into whitespace separated tokens.  Double quotes
 * group (and are removed), a '#' starting a token begins a comment.
 * Returns the token count, or -1 for an unterminated quote / too many tokens.
 */
static int tokenize(char *line, char **tok, int max)
{
    int n = 0;
    char *r = line, *w;
    for (;;) {
        int quoted = 0;
        while (*r == ' ' || *r == '\t' || *r == '\r' || *r == '\n')
            r++;
        if (!*r || *r == '#')
            return n;
        if (n == max)
            return -1;
        tok[n++] = w = r;
        while (*r && (quoted || !(*r == ' ' || *r == '\t' || *r == '\r' || *r == '\n'))) {
            if (*r == '"')
                quoted = !quoted;
            else
                *w++ = *r;
            r++;
        }
        if (quoted)
            return -1;
        if (*r)
            r++;
        *w = 0;
    }
}

static unsigned long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static unsigned long long realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

static int copy_field(char *dst, size_t cap, const char *src)
{
    size_t n = strlen(src);
    if (n == 0 || n >= cap)
        return -1;
    memcpy(dst, src, n + 1);
    return 0;
}

/* One process, PID[:MIB][:KIND][@GI/CI] (see the header comment); returns 0 or -1. */
static int parse_proc(const char *item, struct fake_proc *out)
{
    char buf[96], *f[3], *c, *at;
    unsigned long long u;
    size_t len = strlen(item);
    int nf = 0, i = 1;
    if (len == 0 || len >= sizeof buf)
        return -1;
    memcpy(buf, item, len + 1);
    memset(out, 0, sizeof *out);
    out->gi = out->ci = ID_ANY;
    out->mem = NVML_VALUE_NOT_AVAILABLE_ULL;
    out->kinds = K_COMPUTE;
    if ((at = strchr(buf, '@')) != NULL) {
        char *slash = strchr(at + 1, '/');
        if (!slash)
            return -1;
        *at = *slash = 0;
        if (parse_ull(at + 1, 10, MIG_MAX_GI, &u))
            return -1;
        out->gi = (unsigned)u;
        if (parse_ull(slash + 1, 10, MIG_MAX_CI, &u))
            return -1;
        out->ci = (unsigned)u;
    }
    for (c = buf, f[nf++] = c; (c = strchr(c, ':')) != NULL; f[nf++] = c) {
        if (nf == 3)
            return -1;
        *c++ = 0;
    }
    if (parse_ull(f[0], 10, 0xFFFFFFFFULL, &u) || u == 0)
        return -1;
    out->pid = (unsigned)u;
    if (i < nf && f[i][0] >= '0' && f[i][0] <= '9') {
        if (parse_ull(f[i++], 10, 1ULL << 30, &u))
            return -1;
        out->mem = u << 20;
    }
    if (i < nf) {   /* KIND[+KIND...] */
        char *k = f[i++], *plus;
        out->kinds = 0;
        for (;;) {
            size_t x, nk = sizeof proc_kinds / sizeof proc_kinds[0];
            if ((plus = strchr(k, '+')) != NULL)
                *plus = 0;
            for (x = 0; x < nk && strcmp(k, proc_kinds[x].name); x++)
                ;
            if (x == nk)
                return -1;
            out->kinds |= proc_kinds[x].bit;
            if (!plus)
                break;
            k = plus + 1;
        }
    }
    return i < nf ? -1 : 0;
}

/*
 * A process list, "-" or <proc>[,<proc>...], into p[PROCS_MAX] (v is cut up).
 * Returns the count, or -1 with a message in err.
 */
static int parse_procs(char *v, struct fake_proc *p, char *err, size_t errlen)
{
    char *item, *comma;
    int n = 0, j;
    if (!strcmp(v, "-"))
        return 0;
    for (item = v;; item = comma + 1) {
        if ((comma = strchr(item, ',')) != NULL)
            *comma = 0;
        if (n == PROCS_MAX) {
            snprintf(err, errlen, "more than %d processes", PROCS_MAX);
            return -1;
        }
        if (parse_proc(item, &p[n])) {
            snprintf(err, errlen, "bad process '%s' (want PID[:MIB][:compute|graphics|mps][@GI/CI])", item);
            return -1;
        }
        for (j = 0; j < n; j++)
            if (p[j].pid == p[n].pid) {
                snprintf(err, errlen, "duplicate pid %u", p[n].pid);
                return -1;
            }
        n++;
        if (!comma)
            return n;
    }
}

/*
 * Parses gpu key=value tokens into *d, filling defaults derived from the
 * slot number, and checks uniqueness against the GPUs not removed.
 * Returns 0, or -1 with a message in err.
 */
static int parse_gpu(char **tok, int n, int slot, struct fake_dev *d, char *err, size_t errlen)
{
    int i, j;
    memset(d, 0, sizeof *d);
    snprintf(d->uuid, sizeof d->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", (unsigned)slot);
    snprintf(d->name, sizeof d->name, "NVIDIA H100 80GB HBM3");
    snprintf(d->serial, sizeof d->serial, "%llu", 1650923000000ULL + (unsigned)slot);
    d->bus = 0x80u + (unsigned)slot;
    d->minor = (unsigned)slot;
    d->numa = -1;
    d->memory_mib = 81559;
    d->cc_major = 9;
    d->pci_device_id = 0x233010DE;
    d->pci_subsystem_id = 0x16C110DE;
    d->events = EV_DEFAULT;
    /* An idle H100 SXM at its default clocks. */
    d->temp_c = 34;
    d->mem_temp_c = 38;
    d->power_mw = 69000;
    d->sm_mhz = 1980;
    d->mem_mhz = 2619;
    d->throttle = 0x1;   /* nvmlClocksEventReasonGpuIdle */
    clock_gettime(CLOCK_MONOTONIC, &d->energy_since);
    d->levels_since = mono_ns();   /* every GPM level and NVLink rate 0 so far */

    for (i = 0; i < n; i++) {
        char *k = tok[i], *v = strchr(tok[i], '=');
        unsigned long long u;
        long l;
        int bad = 0;
        if (!v) {
            snprintf(err, errlen, "expected key=value, got '%s'", k);
            return -1;
        }
        *v++ = 0;
        if (!strcmp(k, "uuid"))
            bad = copy_field(d->uuid, 80, v);   /* must fit NVML_DEVICE_UUID_BUFFER_SIZE */
        else if (!strcmp(k, "name"))
            bad = copy_field(d->name, 64, v);   /* must fit NVML_DEVICE_NAME_BUFFER_SIZE */
        else if (!strcmp(k, "serial"))
            bad = copy_field(d->serial, 30, v);
        else if (!strcmp(k, "bus"))
            bad = parse_busid(v, &d->domain, &d->bus, &d->devno, &d->func);
        else if (!strcmp(k, "minor")) {
            bad = parse_ull(v, 10, 255, &u);
            d->minor = (unsigned)u;
        } else if (!strcmp(k, "numa")) {
            bad = parse_int(v, -1, 1023, &l);
            d->numa = (int)l;
        } else if (!strcmp(k, "memory_mib")) {
            bad = parse_ull(v, 10, 1ULL << 30, &u);
            d->memory_mib = u;
        } else if (!strcmp(k, "cc")) {
            char *end;
            long ma = strtol(v, &end, 10), mi = -1;
            if (end != v && *end == '.' && end[1])
                mi = strtol(end + 1, &end, 10);
            bad = *end || ma < 1 || ma > 99 || mi < 0 || mi > 99;
            d->cc_major = (int)ma;
            d->cc_minor = (int)mi;
        } else if (!strcmp(k, "pci_device_id")) {
            bad = parse_ull(v, 16, 0xFFFFFFFFULL, &u);
            d->pci_device_id = (unsigned)u;
        } else if (!strcmp(k, "pci_subsystem_id")) {
            bad = parse_ull(v, 16, 0xFFFFFFFFULL, &u);
            d->pci_subsystem_id = (unsigned)u;
        } else if (!strcmp(k, "events")) {
            bad = parse_ull(v, 16, ~0ULL, &u);
            d->events = u;
        } else if (!strcmp(k, "lost")) {
            bad = parse_ull(v, 10, 1, &u);
            d->lost = (int)u;
        } else if (!strcmp(k, "pending_pages")) {
            bad = parse_ull(v, 10, 1, &u);
            d->pending_pages = (unsigned)u;
        } else if (!strcmp(k, "remap_pending")) {
            bad = parse_ull(v, 10, 1, &u);
            d->remap_pending = (unsigned)u;
        } else if (!strcmp(k, "remap_failure")) {
            bad = parse_ull(v, 10, 1, &u);
            d->remap_failure = (unsigned)u;
        } else if (!strcmp(k, "recovery_action")) {
            bad = parse_ull(v, 10, 0xFFFF, &u);
            d->recovery_action = (unsigned)u;
        } else if (!strcmp(k, "mig")) {
            bad = parse_ull(v, 10, 1, &u);
            d->mig_mode = (int)u;
        } else if (!strcmp(k, "compute_mode")) {
            bad = parse_cm(v, &d->compute_mode);
        } else if (!strcmp(k, "procs")) {
            int np = parse_procs(v, d->procs, err, errlen);
            if (np < 0)
                return -1;
            d->nprocs = np;
        } else if (!strcmp(k, "unsupported")) {
            char *save = NULL, *item;
            for (item = strtok_r(v, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
                size_t x, nn = sizeof unsupported_names / sizeof unsupported_names[0];
                for (x = 0; x < nn && strcmp(item, unsupported_names[x].name); x++)
                    ;
                if (x == nn) {
                    snprintf(err, errlen, "unknown unsupported= item '%s'", item);
                    return -1;
                }
                d->unsupported |= unsupported_names[x].bit;
            }
        } else {
            snprintf(err, errlen, "unknown gpu key '%s'", k);
            return -1;
        }
        if (bad) {
            snprintf(err, errlen, "bad value for %s: '%s'", k, v);
            return -1;
        }
    }
    if (d->mig_mode && (d->unsupported & U_MIG)) {
        snprintf(err, errlen, "mig=1 on a GPU with unsupported=mig");
        return -1;
    }
    for (j = 0; j < g_nslots; j++) {
        const struct fake_dev *o = &g_devs[j];
        if (o->removed)
            continue;
        if (!strcmp(o->uuid, d->uuid)) {
            snprintf(err, errlen, "duplicate uuid %s", d->uuid);
            return -1;
        }
        if (o->minor == d->minor) {
            snprintf(err, errlen, "duplicate minor %u", d->minor);
            return -1;
        }
        if (o->domain == d->domain && o->bus == d->bus && o->devno == d->devno && o->func == d->func) {
            snprintf(err, errlen, "duplicate bus id");
            return -1;
        }
    }
    return 0;
}

/* ---- MIG devices ---------------------------------------------------------------- */

static unsigned long long fnv1a(const char *s, unsigned long long h)
{
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001B3ULL;
    }
    return h;
}

/* MIG-<uuid> from two FNV-1a hashes of "<parent uuid>/<gi>/<ci>"; fakenvml_devices.mig_uuid mirrors it. */
static void mig_default_uuid(const char *parent, unsigned gi, unsigned ci, char *out, size_t cap)
{
    char key[128];
    unsigned long long a, b;
    snprintf(key, sizeof key, "%s/%u/%u", parent, gi, ci);
    a = fnv1a(key, 0xCBF29CE484222325ULL);
    b = fnv1a(key, 0x84222325CBF29CE4ULL);
    snprintf(out, cap, "MIG-%08llx-%04llx-%04llx-%04llx-%012llx", a >> 32, (a >> 16) & 0xFFFF, a & 0xFFFF,
             b >> 48, b & 0xFFFFFFFFFFFFULL);
}

static int profile_index(const char *name)
{
    int i;
    for (i = 0; i < N_PROFILES; i++)
        if (!strcmp(mig_profiles[i].name, name))
            return i;
    return -1;
}

static unsigned used_slices(const struct fake_dev *d)
{
    unsigned n = 0;
    int i;
    for (i = 0; i < d->nmig; i++)
        n += mig_profiles[g_migs[d->mig[i]].profile].slices;
    return n;
}

/* Drops every MIG device of a GPU; their handles go stale and the processes on them end. */
static void mig_clear(struct fake_dev *d)
{
    int i, n = 0;
    for (i = 0; i < d->nmig; i++)
        g_migs[d->mig[i]].used = 0;
    d->nmig = 0;
    for (i = 0; i < d->nprocs; i++)
        if (d->procs[i].gi == ID_ANY)
            d->procs[n++] = d->procs[i];
    d->nprocs = n;
}

/* Processes placed @GI/CI need that MIG device on d now; returns 0 or -1 with err set. */
static int procs_check_mig(const struct fake_dev *d, const struct fake_proc *p, int n, char *err, size_t errlen)
{
    int i, k;
    for (i = 0; i < n; i++) {
        if (p[i].gi == ID_ANY)
            continue;
        for (k = 0; k < d->nmig; k++)
            if (g_migs[d->mig[k]].gi == p[i].gi && g_migs[d->mig[k]].ci == p[i].ci)
                break;
        if (k == d->nmig) {
            snprintf(err, errlen, "process %u: no MIG device with gi %u ci %u on %s", p[i].pid, p[i].gi, p[i].ci,
                     d->uuid);
            return -1;
        }
    }
    return 0;
}

/*
 * The compute mode's rules for a new process list p[n] on d in mode (see
 * "Compute mode" in the header comment): EXCLUSIVE_PROCESS (and the removed
 * EXCLUSIVE_THREAD) allow one process of KIND compute, PROHIBITED none of
 * KIND compute or mps.  Not enforced in MIG mode.  Returns 0 or -1 with err set.
 */
static int procs_check_mode(const struct fake_dev *d, int mode, const struct fake_proc *p, int n, char *err,
                            size_t errlen)
{
    int i, compute = 0;
    if (d->mig_mode)
        return 0;
    for (i = 0; i < n; i++) {
        if (mode == NVML_COMPUTEMODE_PROHIBITED && (p[i].kinds & (K_COMPUTE | K_MPS))) {
            snprintf(err, errlen, "process %u: %s is in compute mode PROHIBITED (2): no compute or MPS processes",
                     p[i].pid, d->uuid);
            return -1;
        }
        if ((p[i].kinds & K_COMPUTE) && ++compute > 1 &&
            (mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS || mode == NVML_COMPUTEMODE_EXCLUSIVE_THREAD)) {
            snprintf(err, errlen,
                     "process %u: %s is in compute mode %s (%d): one compute process at most "
                     "(an MPS server; its clients are KIND mps)",
                     p[i].pid, d->uuid, cm_names[mode], mode);
            return -1;
        }
    }
    return 0;
}

static int gi_taken(const struct fake_dev *d, unsigned gi)
{
    int i;
    for (i = 0; i < d->nmig; i++)
        if (g_migs[d->mig[i]].gi == gi)
            return 1;
    return 0;
}

static int uuid_taken(const char *uuid)
{
    int i;
    for (i = 0; i < g_nslots; i++)
        if (!g_devs[i].removed && !strcmp(g_devs[i].uuid, uuid))
            return 1;
    for (i = 0; i < MIG_SLOTS; i++)
        if (g_migs[i].used && !strcmp(g_migs[i].uuid, uuid))
            return 1;
    return 0;
}

/*
 * Appends a MIG device to GPU slot; gi < 0 picks the lowest free id from 1,
 * uuid NULL the derived one.  Returns 0, or -1 with err set (nothing changed).
 */
static int mig_add(int slot, int profile, long gi, long ci, const char *uuid, char *err, size_t errlen)
{
    struct fake_dev *d = &g_devs[slot];
    struct fake_mig *m;
    char id[96];
    int i;
    if (!d->mig_mode) {
        snprintf(err, errlen, "MIG device on a GPU with mig=0");
        return -1;
    }
    if (used_slices(d) + mig_profiles[profile].slices > MIG_PER_GPU) {
        snprintf(err, errlen, "MIG layout over %d slices (%u used, %s needs %u)", MIG_PER_GPU, used_slices(d),
                 mig_profiles[profile].name, mig_profiles[profile].slices);
        return -1;
    }
    if (gi < 0)
        for (gi = 1; gi <= MIG_MAX_GI && gi_taken(d, (unsigned)gi); gi++)
            ;
    if (gi_taken(d, (unsigned)gi)) {
        snprintf(err, errlen, "duplicate gi %ld", gi);
        return -1;
    }
    if (uuid)
        snprintf(id, sizeof id, "%s", uuid);
    else
        mig_default_uuid(d->uuid, (unsigned)gi, (unsigned)ci, id, sizeof id);
    if (uuid_taken(id)) {
        snprintf(err, errlen, "duplicate uuid %s", id);
        return -1;
    }
    for (i = 0; i < MIG_SLOTS && g_migs[(g_mig_next + i) % MIG_SLOTS].used; i++)
        ;
    if (i == MIG_SLOTS) {   /* cannot happen: MIG_PER_GPU per GPU slot */
        snprintf(err, errlen, "out of MIG device slots");
        return -1;
    }
    i = (g_mig_next + i) % MIG_SLOTS;
    g_mig_next = (i + 1) % MIG_SLOTS;
    m = &g_migs[i];
    memset(m, 0, sizeof *m);
    m->used = 1;
    m->parent = slot;
    m->profile = profile;
    m->gi = (unsigned)gi;
    m->ci = (unsigned)ci;
    memcpy(m->uuid, id, sizeof m->uuid);
    d->mig[d->nmig++] = i;
    return 0;
}

/* Scenario "mig <gpu-index> <profile> [gi=N] [ci=N] [uuid=MIG-...]". */
static int parse_mig_line(char **tok, int n, char *err, size_t errlen)
{
    long idx, gi = -1, ci = 0;
    const char *uuid = NULL;
    int i, profile;
    if (n < 3 || parse_int(tok[1], 0, g_nslots - 1, &idx)) {
        snprintf(err, errlen, "mig needs the index of a GPU defined above and a profile");
        return -1;
    }
    if ((profile = profile_index(tok[2])) < 0) {
        snprintf(err, errlen, "unknown MIG profile '%s'", tok[2]);
        return -1;
    }
    for (i = 3; i < n; i++) {
        const char *v = strchr(tok[i], '=');
        int bad;
        if (!v) {
            snprintf(err, errlen, "expected key=value, got '%s'", tok[i]);
            return -1;
        }
        v++;
        if (!strncmp(tok[i], "gi=", 3))
            bad = parse_int(v, 0, MIG_MAX_GI, &gi);
        else if (!strncmp(tok[i], "ci=", 3))
            bad = parse_int(v, 0, MIG_MAX_CI, &ci);
        else if (!strncmp(tok[i], "uuid=", 5)) {
            bad = strncmp(v, "MIG-", 4) || strlen(v) < 5 || strlen(v) >= 80;
            uuid = v;
        } else {
            snprintf(err, errlen, "unknown mig key '%.*s'", (int)(v - 1 - tok[i]), tok[i]);
            return -1;
        }
        if (bad) {
            snprintf(err, errlen, "bad value for %s", tok[i]);
            return -1;
        }
    }
    return mig_add((int)idx, profile, gi, ci, uuid, err, errlen);
}

/* Adds a GPU; it becomes visible at the next 0->1 init. It takes the slot of
 * a GPU that is gone for good (removed, and not enumerated since), so endless
 * add/remove cycles fit in MAX_GPUS; a stale handle to the old one then names
 * the new GPU. final: no mig lines can follow (the add command), so processes
 * placed on MIG devices are an error now, not at the end of the scenario.
 * Returns the slot, or -1. */
static int add_gpu(char **tok, int n, int final, char *err, size_t errlen)
{
    struct fake_dev d;
    int slot, j;
    for (slot = 0; slot < g_nslots; slot++)
        if (g_devs[slot].removed && !g_devs[slot].visible)
            break;
    if (slot >= MAX_GPUS) {
        snprintf(err, errlen, "too many GPUs (max %d)", MAX_GPUS);
        return -1;
    }
    if (parse_gpu(tok, n, slot, &d, err, errlen))
        return -1;
    if (final && (procs_check_mig(&d, d.procs, d.nprocs, err, errlen) ||
                  procs_check_mode(&d, d.compute_mode, d.procs, d.nprocs, err, errlen)))
        return -1;
    for (j = 0; j < MAX_GPUS; j++) {   /* no links survive from the slot's last GPU */
        g_nvlink[slot][j] = g_nvlink[j][slot] = 0;
        g_pcie[slot][j] = g_pcie[j][slot] = NVML_TOPOLOGY_SYSTEM;
    }
    mig_clear(&g_devs[slot]);   /* the old GPU's MIG handles go stale */
    if (slot < g_nslots) {   /* nor do its blocks carry over; callers asleep on it start over */
        memset(g_blocks[slot], 0, sizeof g_blocks[slot]);
        pthread_cond_broadcast(&g_block_cond);
    }
    g_devs[slot] = d;
    if (slot == g_nslots)
        g_nslots++;
    return slot;
}

static int parse_link(int a, int b, char **tok, int n, char *err, size_t errlen)
{
    int i, nv = 0, lvl = NVML_TOPOLOGY_SYSTEM;
    if (a == b) {
        snprintf(err, errlen, "link from a GPU to itself");
        return -1;
    }
    for (i = 0; i < n; i++) {
        char *v = strchr(tok[i], '=');
        long l;
        if (v && !strncmp(tok[i], "nvlink=", 7)) {
            if (parse_int(v + 1, 0, NVLINK_MAX, &l)) {
                snprintf(err, errlen, "bad nvlink count '%s' (0-%d)", v + 1, NVLINK_MAX);
                return -1;
            }
            nv = (int)l;
        } else if (v && !strncmp(tok[i], "pcie=", 5)) {
            if (parse_level(v + 1, &lvl)) {
                snprintf(err, errlen, "bad pcie level '%s'", v + 1);
                return -1;
            }
        } else {
            snprintf(err, errlen, "unknown link key '%s'", tok[i]);
            return -1;
        }
    }
    g_nvlink[a][b] = g_nvlink[b][a] = (unsigned char)nv;
    g_pcie[a][b] = g_pcie[b][a] = (unsigned char)lvl;
    return 0;
}

/* One scenario line; returns 0 or -1 with err set. */
static int scenario_line(char *line, char *err, size_t errlen)
{
    char *tok[64];
    int n = tokenize(line, tok, 64);
    long l;
    if (n < 0) {
        snprintf(err, errlen, "unterminated quote or too many tokens");
        return -1;
    }
    if (n == 0)
        return 0;
    if (!strcmp(tok[0], "gpu"))
        return add_gpu(tok + 1, n - 1, 0, err, errlen) < 0 ? -1 : 0;
    if (!strcmp(tok[0], "link")) {
        long a, b;
        if (n < 3 || parse_int(tok[1], 0, g_nslots - 1, &a) || parse_int(tok[2], 0, g_nslots - 1, &b)) {
            snprintf(err, errlen, "link needs two indices of GPUs defined above");
            return -1;
        }
        return parse_link((int)a, (int)b, tok + 3, n - 3, err, errlen);
    }
    if (!strcmp(tok[0], "mig"))
        return parse_mig_line(tok, n, err, errlen);
    if (n != 2) {
        snprintf(err, errlen, "unknown line or wrong number of values");
        return -1;
    }
    if (!strcmp(tok[0], "driver"))
        return copy_field(g_driver, sizeof g_driver, tok[1]) ? (snprintf(err, errlen, "bad driver"), -1) : 0;
    if (!strcmp(tok[0], "nvml"))
        return copy_field(g_nvml, sizeof g_nvml, tok[1]) ? (snprintf(err, errlen, "bad nvml"), -1) : 0;
    if (!strcmp(tok[0], "cuda")) {
        if (parse_int(tok[1], 0, 1000000, &l))
            return snprintf(err, errlen, "bad cuda version"), -1;
        g_cuda = (int)l;
        return 0;
    }
    if (!strcmp(tok[0], "init_error")) {
        if (parse_int(tok[1], 0, 999, &l))
            return snprintf(err, errlen, "bad init_error"), -1;
        g_init_error = (nvmlReturn_t)l;
        return 0;
    }
    snprintf(err, errlen, "unknown keyword '%s'", tok[0]);
    return -1;
}

static void reset_state(void)
{
    memset(g_devs, 0, sizeof g_devs);
    memset(g_nvlink, 0, sizeof g_nvlink);
    memset(g_pcie, NVML_TOPOLOGY_SYSTEM, sizeof g_pcie);
    memset(g_migs, 0, sizeof g_migs);
    g_mig_next = 0;
    g_nslots = g_count = 0;
    g_init_error = NVML_SUCCESS;
}

static const char *builtin_scenario[] = {
    "gpu uuid=GPU-fa4e0000-0000-4000-8000-000000000000 name=\"NVIDIA H100 80GB HBM3\" minor=0 "
    "bus=0000:18:00.0 numa=0 memory_mib=81559 cc=9.0 pci_device_id=0x233010DE serial=1650923000000",
};

/* Loads the scenario (caller holds g_lock).  Failure leaves nothing loaded. */
static int load_scenario(void)
{
    const char *path = getenv("FAKE_NVML_SCENARIO");
    char err[256];
    int lineno = 0, rc = 0, slot;
    reset_state();
    if (!path || !*path) {
        size_t i;
        for (i = 0; i < sizeof builtin_scenario / sizeof builtin_scenario[0]; i++) {
            char buf[512];
            snprintf(buf, sizeof buf, "%s", builtin_scenario[i]);
            if (scenario_line(buf, err, sizeof err))
                abort();   /* the built-in text is wrong: a bug in this file */
        }
        return 0;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fakenvml: cannot open scenario %s: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL, *copy;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = 0;
        copy = strdup(line);   /* tokenize mangles the line; keep it for the message */
        if (scenario_line(line, err, sizeof err)) {
            fprintf(stderr, "fakenvml: %s:%d: %s: %s\n", path, lineno, err, copy ? copy : "");
            free(copy);
            rc = -1;
            break;
        }
        free(copy);
    }
    free(line);
    fclose(f);
    for (slot = 0; rc == 0 && slot < g_nslots; slot++) {   /* procs=...@GI/CI needed the mig lines */
        const struct fake_dev *d = &g_devs[slot];
        if (procs_check_mig(d, d->procs, d->nprocs, err, sizeof err) ||
            procs_check_mode(d, d->compute_mode, d->procs, d->nprocs, err, sizeof err)) {
            fprintf(stderr, "fakenvml: %s: gpu %d: %s\n", path, slot, err);
            rc = -1;
        }
    }
    if (rc)
        reset_state();
    return rc;
}

/* A 0->1 init: enumerate GPUs, dropping removed ones and adding new ones. */
static void apply_pending(void)
{
    int s;
    g_count = 0;
    for (s = 0; s < g_nslots; s++) {
        struct fake_dev *d = &g_devs[s];
        d->visible = !d->removed;
        if (d->visible) {
            d->ever_visible = 1;
            g_order[g_count++] = s;
        }
    }
}

/* ---- driver state: compute modes ------------------------------------------------ */

/*
 * The compute modes set since the driver "loaded", by GPU UUID: driver
 * state, which outlives the processes that set it (see "Compute mode" in the
 * header comment).  With a state file this table is a copy of it, read again
 * at each use (cm_sync), so that every process of the node sees what any of
 * them set; without one it lives in this process only.  Guarded by g_lock.
 */
#define CM_MAX 256   /* GPUs with a mode set, per node */
#define STATE_FILE "fakenvml.state"
static struct { char uuid[96]; int mode; } g_cm[CM_MAX];
static int g_ncm;
static char g_state_path[PATH_MAX];
static int g_state_resolved;

/* FAKE_NVML_STATE_DIR/fakenvml.state, else beside FAKE_NVML_CONTROL; NULL: no file (empty dir, neither set). */
static const char *state_path(void)
{
    const char *dir, *ctl;
    if (g_state_resolved)
        return g_state_path[0] ? g_state_path : NULL;
    g_state_resolved = 1;
    dir = getenv("FAKE_NVML_STATE_DIR");
    ctl = getenv("FAKE_NVML_CONTROL");
    if (dir) {
        if (*dir)
            snprintf(g_state_path, sizeof g_state_path, "%s/%s", dir, STATE_FILE);
    } else if (ctl && *ctl) {
        const char *slash = strrchr(ctl, '/');
        if (slash)
            snprintf(g_state_path, sizeof g_state_path, "%.*s/%s", (int)(slash - ctl), ctl, STATE_FILE);
        else
            snprintf(g_state_path, sizeof g_state_path, "%s", STATE_FILE);
    }
    return g_state_path[0] ? g_state_path : NULL;
}

/*
 * Reloads g_cm from the state file: lines "<uuid> compute_mode=<n>" ('#'
 * comments; other keys and bad lines are skipped).  No file is an empty
 * table (a driver reload: every GPU back to its gpu line's mode); a file
 * that cannot be read leaves the table as it was.
 */
static void cm_sync(void)
{
    static int warned;
    const char *path = state_path();
    char line[256], *tok[16];
    FILE *f;
    if (!path)
        return;
    f = fopen(path, "re");
    if (!f) {
        if (errno == ENOENT)
            g_ncm = 0;
        else if (!warned++)
            fprintf(stderr, "fakenvml: cannot read %s: %s (compute modes: this process's view)\n", path,
                    strerror(errno));
        return;
    }
    g_ncm = 0;
    while (fgets(line, sizeof line, f)) {
        int n = tokenize(line, tok, 16), i, mode = -1;
        for (i = 1; i < n; i++)
            if (!strncmp(tok[i], "compute_mode=", 13) && parse_cm(tok[i] + 13, &mode))
                mode = -1;
        if (n < 2 || mode < 0 || g_ncm == CM_MAX || copy_field(g_cm[g_ncm].uuid, sizeof g_cm[0].uuid, tok[0]))
            continue;
        g_cm[g_ncm++].mode = mode;
    }
    fclose(f);
}

/* The GPU's compute mode now (after a cm_sync): the driver state's, else its gpu line's. */
static int cm_of(const struct fake_dev *d)
{
    int i;
    for (i = 0; i < g_ncm; i++)
        if (!strcmp(g_cm[i].uuid, d->uuid))
            return g_cm[i].mode;
    return d->compute_mode;
}

/* Writes g_cm to path atomically: a temporary file renamed over it. */
static int cm_write(const char *path)
{
    char tmp[PATH_MAX + 32];
    FILE *f;
    int i, ok;
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    if (!(f = fopen(tmp, "we")))
        return -1;
    fprintf(f, "# fake NVML driver state (fakenvml.c): <gpu uuid> compute_mode=<nvmlComputeMode_t>\n");
    for (i = 0; i < g_ncm; i++)
        fprintf(f, "%s compute_mode=%d\n", g_cm[i].uuid, g_cm[i].mode);
    ok = fflush(f) == 0 && !ferror(f);
    if (fclose(f) != 0)
        ok = 0;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        errno = e;
        return -1;
    }
    return 0;
}

/*
 * Sets a GPU's compute mode in the driver state: with a state file, under a
 * lock on <file>.lock (other processes of the node write it too), reread,
 * changed and written back.  Returns 0, or -1 (a message on stderr) with the
 * state unchanged.
 */
static int cm_store(const char *uuid, int mode)
{
    const char *path = state_path();
    char lockpath[PATH_MAX + 8];
    struct flock fl;
    int lock = -1, i, rc = 0;
    if (path) {
        snprintf(lockpath, sizeof lockpath, "%s.lock", path);
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        if ((lock = open(lockpath, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) >= 0) {
            while ((rc = fcntl(lock, F_SETLKW, &fl)) < 0 && errno == EINTR)
                ;
            if (rc < 0) {
                int e = errno;
                close(lock);
                lock = -1;
                errno = e;
            }
            rc = 0;
        }
        if (lock < 0) {
            fprintf(stderr, "fakenvml: cannot lock %s: %s\n", lockpath, strerror(errno));
            return -1;
        }
        cm_sync();
    }
    for (i = 0; i < g_ncm && strcmp(g_cm[i].uuid, uuid); i++)
        ;
    if (i == CM_MAX) {
        fprintf(stderr, "fakenvml: more than %d GPUs with a compute mode set\n", CM_MAX);
        rc = -1;
    } else {
        int old = i < g_ncm ? g_cm[i].mode : -1;
        if (i == g_ncm)
            snprintf(g_cm[g_ncm++].uuid, sizeof g_cm[0].uuid, "%s", uuid);
        g_cm[i].mode = mode;
        if (path && cm_write(path)) {
            fprintf(stderr, "fakenvml: cannot write %s: %s\n", path, strerror(errno));
            if (old < 0)
                g_ncm--;
            else
                g_cm[i].mode = old;
            rc = -1;
        }
    }
    if (lock >= 0)
        close(lock);   /* drops the lock */
    return rc;
}

/* ---- events ----------------------------------------------------------------- */

/* Queues an event on every set registered for it; returns how many. */
static int deliver(int slot, unsigned long long type, unsigned long long data, unsigned gi, unsigned ci)
{
    struct fake_evset *s;
    int n = 0;
    for (s = g_sets; s; s = s->next) {
        struct ev *e;
        if (!(s->reg[slot] & type))
            continue;
        if (s->count == QCAP) {   /* full: drop the oldest, keep the newest */
            s->head = (s->head + 1) % QCAP;
            s->count--;
            s->dropped++;
        }
        e = &s->q[(s->head + s->count) % QCAP];
        e->slot = slot;
        e->type = type;
        e->data = data;
        e->gi = gi;
        e->ci = ci;
        s->count++;
        pthread_cond_signal(&s->cond);
        n++;
    }
    return n;
}

static int set_valid(nvmlEventSet_t set)
{
    struct fake_evset *s;
    for (s = g_sets; s; s = s->next)
        if (s == set)
            return 1;
    return 0;
}

/* ---- control socket ------------------------------------------------------------ */

/* gpu argument: an index in the current enumeration, or any known UUID. */
static int resolve_gpu(const char *arg)
{
    long idx;
    int s;
    if (parse_int(arg, 0, MAX_GPUS - 1, &idx) == 0)
        return idx < g_count ? g_order[idx] : -1;
    for (s = 0; s < g_nslots; s++)
        if (!strcmp(g_devs[s].uuid, arg))
            return s;
    return -1;
}

/* The commands whose first argument is a GPU. */
static const char *const gpu_cmds[] = {"xid", "ecc", "event", "lose", "restore", "remove", "pending_pages",
                                       "remap", "recovery_action", "mig", "procs", "compute_mode", "telemetry",
                                       "samples", "retire", "gpm"};

static int takes_gpu(const char *cmd)
{
    size_t i;
    for (i = 0; i < sizeof gpu_cmds / sizeof gpu_cmds[0]; i++)
        if (!strcmp(cmd, gpu_cmds[i]))
            return 1;
    return 0;
}

static int index_of(int slot)
{
    int i;
    for (i = 0; i < g_count; i++)
        if (g_order[i] == slot)
            return i;
    return -1;
}

/* One process as PID[:MIB][:KIND][@GI/CI]; returns what snprintf does. */
static size_t proc_format(const struct fake_proc *p, const char *sep, char *out, size_t cap)
{
    char mem[32] = "", kinds[64] = "", mig[32] = "";
    size_t x, used = 0;
    if (p->mem != NVML_VALUE_NOT_AVAILABLE_ULL)
        snprintf(mem, sizeof mem, ":%llu", p->mem >> 20);
    if (p->kinds != K_COMPUTE)
        for (x = 0; x < sizeof proc_kinds / sizeof proc_kinds[0]; x++)
            if (p->kinds & proc_kinds[x].bit)
                used += (size_t)snprintf(kinds + used, sizeof kinds - used, "%s%s", used ? "+" : ":",
                                         proc_kinds[x].name);
    if (p->gi != ID_ANY)
        snprintf(mig, sizeof mig, "@%u/%u", p->gi, p->ci);
    return (size_t)snprintf(out, cap, "%s%u%s%s%s", sep, p->pid, mem, kinds, mig);
}

static int row_blocked(int row)
{
    int f;
    for (f = 0; f < N_FUNCS; f++)
        if (g_blocks[row][f])
            return 1;
    return 0;
}

/* The functions blocked in one g_blocks row, comma separated, or "-"; returns what snprintf does. */
static size_t block_list(int row, char *out, size_t cap)
{
    size_t used = 0;
    int f;
    if (!row_blocked(row))
        return (size_t)snprintf(out, cap, "-");
    for (f = 0; f < N_FUNCS && used < cap; f++)
        if (g_blocks[row][f])
            used += (size_t)snprintf(out + used, cap - used, "%s%s", used ? "," : "", fn_names[f]);
    return used;
}

static void ctl_state(char *out, size_t cap)
{
    size_t used;
    unsigned long long dropped = 0;
    int s, nsets = 0, waiting = 0;
    struct fake_evset *es;
    for (es = g_sets; es; es = es->next, nsets++)
        dropped += es->dropped;
    for (s = 0; s <= MAX_GPUS; s++)
        waiting += g_block_waiters[s];
    cm_sync();
    used = (size_t)snprintf(out, cap,
                            "ok loaded=%d refcount=%d count=%d init_error=%d sets=%d dropped=%llu wait_error=%d"
                            " wait_left=%ld event_waits=%d shutdown_waits=%llu any_latency=%u latency_waiting=%d"
                            " blocked_waiting=%d blocked_calls=%llu any_blocks=",
                            g_loaded, g_refcount, g_count, g_init_error, nsets, dropped, g_wait_error, g_wait_left,
                            g_waiting, g_shutdown_waits, g_latency_us[ANY_GPU], g_latency_waiting, waiting,
                            g_block_calls);
    if (used < cap)
        used += block_list(ANY_GPU, out + used, cap - used);
    for (s = 0; s < g_nslots && used < cap; s++) {
        const struct fake_dev *d = &g_devs[s];
        int idx = index_of(s);
        char ix[16], flags[64];
        size_t fl;
        if (idx >= 0)
            snprintf(ix, sizeof ix, "%d", idx);
        else
            snprintf(ix, sizeof ix, "-");
        fl = (size_t)snprintf(flags, sizeof flags, "%s%s%s%s%s", d->lost ? "lost," : "",
                              d->removed ? (d->visible ? "removing," : "removed,") : "",
                              !d->removed && !d->visible ? "adding," : "", d->pending_pages ? "pages," : "",
                              d->remap_pending || d->remap_failure ? "remap," : "");
        if (fl == 0 || fl >= sizeof flags)
            snprintf(flags, sizeof flags, "ok");
        else
            flags[fl - 1] = 0;   /* drop the trailing comma */
        used += (size_t)snprintf(out + used, cap - used, " | %s %s %s ra=%u cm=%d", ix, d->uuid, flags,
                                 d->recovery_action, cm_of(d));
        if (d->mig_mode && used < cap) {   /* mig=profile/gi/ci/uuid,... ("-": none) */
            int k;
            used += (size_t)snprintf(out + used, cap - used, " mig=%s", d->nmig ? "" : "-");
            for (k = 0; k < d->nmig && used < cap; k++) {
                const struct fake_mig *m = &g_migs[d->mig[k]];
                used += (size_t)snprintf(out + used, cap - used, "%s%s/%u/%u/%s", k ? "," : "",
                                         mig_profiles[m->profile].name, m->gi, m->ci, m->uuid);
            }
        }
        if (d->nprocs && used < cap) {   /* procs=<list> in the syntax procs= takes */
            int k;
            used += (size_t)snprintf(out + used, cap - used, " procs=");
            for (k = 0; k < d->nprocs && used < cap; k++)
                used += proc_format(&d->procs[k], k ? "," : "", out + used, cap - used);
        }
        if (row_blocked(s) && used < cap) {   /* blocks=<function>,... */
            used += (size_t)snprintf(out + used, cap - used, " blocks=");
            if (used < cap)
                used += block_list(s, out + used, cap - used);
        }
        if (g_block_waiters[s] && used < cap)
            used += (size_t)snprintf(out + used, cap - used, " waiting=%d", g_block_waiters[s]);
        if (g_latency_us[s] && used < cap)
            used += (size_t)snprintf(out + used, cap - used, " latency=%u", g_latency_us[s]);
    }
}

static int by_name(const void *a, const void *b)
{
    return strcmp(fn_names[*(const int *)a], fn_names[*(const int *)b]);
}

/* "ok total=N name=n ...": one snapshot of each counter, so the total matches the list. */
static void ctl_calls(char *out, size_t cap)
{
    unsigned long long snap[N_FUNCS], total = 0;
    int order[N_FUNCS], i;
    size_t used;
    for (i = 0; i < N_FUNCS; i++) {
        snap[i] = atomic_load_explicit(&g_calls[i], memory_order_relaxed);
        total += snap[i];
        order[i] = i;
    }
    qsort(order, N_FUNCS, sizeof order[0], by_name);
    used = (size_t)snprintf(out, cap, "ok total=%llu", total);
    for (i = 0; i < N_FUNCS && used < cap; i++)
        if (snap[order[i]])
            used += (size_t)snprintf(out + used, cap - used, " %s=%llu", fn_names[order[i]], snap[order[i]]);
}

static int need_args(int n, int want, const char *usage, char *out, size_t cap)
{
    if (n == want)
        return 0;
    snprintf(out, cap, "error: usage: %s", usage);
    return -1;
}

/*
 * "block <gpu>|* <function>", "release <gpu>|* <function>", "release all"
 * (caller holds g_lock).  A GPU is resolved now, like every command's: the
 * block stays with that GPU whatever the enumeration does later.  Releasing
 * wakes every blocked caller; those that some other block still matches
 * (a "*" one, say) go back to sleep.
 */
static void ctl_block(int set, char **tok, int n, char *out, size_t cap)
{
    const char *cmd = set ? "block" : "release";
    int f, row;
    if (!set && n == 2 && !strcmp(tok[1], "all")) {
        int cleared = 0;
        for (row = 0; row <= MAX_GPUS; row++)
            for (f = 0; f < N_FUNCS; f++) {
                cleared += g_blocks[row][f];
                g_blocks[row][f] = 0;
            }
        pthread_cond_broadcast(&g_block_cond);
        snprintf(out, cap, "ok released=%d", cleared);
        return;
    }
    if (n != 3) {
        snprintf(out, cap, "error: usage: %s <gpu>|* <function>%s", cmd, set ? "" : " | release all");
        return;
    }
    for (f = 0; f < N_FUNCS && strcmp(fn_names[f], tok[2]); f++)
        ;
    if (f == N_FUNCS) {
        snprintf(out, cap, "error: %s: unknown function '%s' (an NVML entry point this fake exports)", cmd, tok[2]);
        return;
    }
    if (!strcmp(tok[1], "*")) {
        row = ANY_GPU;
    } else if (fn_kinds[f] == FK_SYS) {
        snprintf(out, cap, "error: %s: %s takes no device: use '*'", cmd, fn_names[f]);
        return;
    } else if ((row = resolve_gpu(tok[1])) < 0) {
        snprintf(out, cap, "error: %s: unknown gpu '%s'", cmd, tok[1]);
        return;
    }
    if (set) {
        g_blocks[row][f] = 1;
        snprintf(out, cap, "ok");
        return;
    }
    if (!g_blocks[row][f]) {
        snprintf(out, cap, "error: release: %s %s is not blocked", tok[1], fn_names[f]);
        return;
    }
    g_blocks[row][f] = 0;
    pthread_cond_broadcast(&g_block_cond);
    snprintf(out, cap, "ok");
}

/* Total energy now: what was set, plus power_mw over the time since (mW x ms = uJ). */
static unsigned long long energy_now(struct fake_dev *d)
{
    struct timespec now;
    long long ms;
    clock_gettime(CLOCK_MONOTONIC, &now);
    ms = (now.tv_sec - d->energy_since.tv_sec) * 1000LL + (now.tv_nsec - d->energy_since.tv_nsec) / 1000000L;
    return d->energy_mj + (unsigned long long)(ms > 0 ? ms : 0) * d->power_mw / 1000ULL;
}

/* Page retirement lists: GPUs before Ampere (cc < 8); later ones remap rows instead. */
static int retire_supported(const struct fake_dev *d)
{
    return d->cc_major < 8 && !(d->unsupported & U_RETIRED_PAGES);
}

/* GPM: Hopper and later (cc >= 9). */
static int gpm_supported(const struct fake_dev *d)
{
    return d->cc_major >= 9 && !(d->unsupported & U_GPM);
}

/*
 * The clocks event reasons behind each performance policy's violation time (nvmlPerfPolicyType_t 0-5:
 * power, thermal, sync boost, board limit, low utilization, reliability): the power cap or the power brake;
 * a software or hardware thermal slowdown; sync boost; a hardware slowdown; the GPU idle; none modelled.
 * Then the total below application clocks (policy 10): any of them.
 */
static const unsigned long long viol_reasons[VIOL_N] = {0x4 | 0x80, 0x20 | 0x40, 0x10, 0x8, 0x1, 0, 0xFD};

/*
 * Brings what grows at a level up to now, each at the level held since levels_since: GPM's integrals,
 * NVLink's counts, the violation times of the reasons throttle holds.  Called before a level changes (the
 * old one counts up to then) and before a read; returns now.
 */
static unsigned long long levels_advance(struct fake_dev *d)
{
    unsigned long long now = mono_ns();
    int i;
    if (now > d->levels_since) {
        double secs = (double)(now - d->levels_since) / 1e9;
        for (i = 0; i < GPM_N; i++)
            d->gpm_integral[i] += d->gpm_level[i] * secs;
        for (i = 0; i < 2; i++)
            d->nvlink_kib[i] += d->nvlink_mibps[i] * 1024.0 * secs;
        for (i = 0; i < VIOL_N; i++)
            if (d->throttle & viol_reasons[i])
                d->viol_ns[i] += now - d->levels_since;
        d->levels_since = now;
    }
    return d->levels_since;
}

/*
 * "retire <gpu> sbe|dbe [count]": count pages (default 1) retired now for that cause, each at an
 * address no other page of the GPU has, stamped now (CLOCK_REALTIME microseconds).  Permanent:
 * restore keeps them, as a reset keeps the retirement list in the InfoROM.
 */
static void ctl_retire(struct fake_dev *d, char **tok, int n, char *out, size_t cap)
{
    unsigned long long us;
    unsigned *have;
    long count = 1, k;
    int cause;
    if (n != 3 && n != 4) {
        snprintf(out, cap, "error: usage: retire <gpu> sbe|dbe [count]");
        return;
    }
    if (strcmp(tok[2], "sbe") && strcmp(tok[2], "dbe")) {
        snprintf(out, cap, "error: retire: cause must be sbe or dbe, got '%s'", tok[2]);
        return;
    }
    if (n == 4 && parse_int(tok[3], 1, RETIRED_MAX, &count)) {
        snprintf(out, cap, "error: retire: count must be 1 to %d", RETIRED_MAX);
        return;
    }
    if (!retire_supported(d)) {
        snprintf(out, cap, "error: retire: the GPU has no page retirement (%s)",
                 d->cc_major >= 8 ? "cc 8.0 or later: it remaps rows" : "unsupported=retired_pages");
        return;
    }
    cause = !strcmp(tok[2], "dbe") ? NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
                                   : NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS;
    have = &d->nretired[cause];
    if (*have + (unsigned long)count > RETIRED_MAX) {
        snprintf(out, cap, "error: retire: %u %s pages retired already, at most %d kept", *have, tok[2],
                 RETIRED_MAX);
        return;
    }
    us = realtime_us();
    for (k = 0; k < count; k++, (*have)++) {
        /* Page-aligned (4 KiB) addresses, spread out, never repeated on the GPU. */
        d->retired_addr[cause][*have] = 0x1a2b000ULL + d->retired_next++ * 0x3f1000ULL;
        d->retired_us[cause][*have] = us;
    }
    snprintf(out, cap, "ok pages=%u", *have);
}

/* One GPM level, a decimal number 0..max (fractions allowed); returns 0 or -1. */
static int parse_gpm_level(const char *s, double max, double *out)
{
    char *end;
    double v;
    if (!*s || !((*s >= '0' && *s <= '9') || *s == '.'))
        return -1;
    errno = 0;
    v = strtod(s, &end);
    if (errno || *end || !(v >= 0 && v <= max))
        return -1;
    *out = v;
    return 0;
}

/*
 * "gpm <gpu> name=value ...": GPM activity levels from now on (names in gpm_metrics; the others
 * keep theirs).  All or nothing: any bad item is an error and changes no level.
 */
static void ctl_gpm(struct fake_dev *d, char **tok, int n, char *out, size_t cap)
{
    double v[GPM_N];
    int set[GPM_N] = {0}, i, k;
    if (n < 3) {
        snprintf(out, cap, "error: usage: gpm <gpu> name=value ... (graphics sm sm_occupancy integer tensor "
                           "dfma hmma imma dram fp64 fp32 fp16: percent; pcie_tx pcie_rx: MiB/s)");
        return;
    }
    for (i = 2; i < n; i++) {
        char *eq = strchr(tok[i], '=');
        for (k = 0; eq && k < GPM_N; k++)
            if ((size_t)(eq - tok[i]) == strlen(gpm_metrics[k].name) &&
                !strncmp(tok[i], gpm_metrics[k].name, (size_t)(eq - tok[i])))
                break;
        if (!eq || k == GPM_N) {
            snprintf(out, cap, "error: gpm: unknown item '%s'", tok[i]);
            return;
        }
        if (parse_gpm_level(eq + 1, gpm_metrics[k].max, &v[k])) {
            snprintf(out, cap, "error: gpm: bad value in '%s' (0 to %g)", tok[i], gpm_metrics[k].max);
            return;
        }
        set[k] = 1;
    }
    if (!gpm_supported(d)) {
        snprintf(out, cap, "error: gpm: the GPU has no GPM (%s)",
                 d->cc_major < 9 ? "cc before 9.0" : "unsupported=gpm");
        return;
    }
    levels_advance(d);   /* the old levels up to now; the new ones from now */
    for (k = 0; k < GPM_N; k++)
        if (set[k])
            d->gpm_level[k] = v[k];
    snprintf(out, cap, "ok");
}

/*
 * "telemetry <gpu> key=value ...": util mem_util enc_util dec_util (percent), temp mem_temp (C),
 * power_mw, energy_mj, sm_clock mem_clock (MHz), throttle (a bitmask, 0x... or decimal), pcie_replays,
 * reserved_mib, nvlink_tx nvlink_rx (MiB/s).
 */
static void ctl_telemetry(struct fake_dev *d, char **tok, int n, char *out, size_t cap)
{
    static const struct { const char *key; unsigned long long max; } keys[] = {
        {"util", 100}, {"mem_util", 100}, {"temp", 200}, {"power_mw", 2000000}, {"energy_mj", ~0ULL},
        {"sm_clock", 10000}, {"mem_clock", 20000}, {"throttle", ~0ULL}, {"pcie_replays", 0xFFFFFFFFULL},
        {"reserved_mib", 1 << 24}, {"mem_temp", 200}, {"enc_util", 100}, {"dec_util", 100},
        {"nvlink_tx", 1 << 20}, {"nvlink_rx", 1 << 20},
    };
    unsigned long long v[sizeof keys / sizeof keys[0]];
    int set[sizeof keys / sizeof keys[0]] = {0}, i;
    size_t k;
    if (n < 3) {
        snprintf(out, cap, "error: usage: telemetry <gpu> key=value ... (util mem_util temp power_mw energy_mj "
                           "sm_clock mem_clock throttle pcie_replays reserved_mib mem_temp enc_util dec_util "
                           "nvlink_tx nvlink_rx)");
        return;
    }
    for (i = 2; i < n; i++) {
        char *eq = strchr(tok[i], '=');
        for (k = 0; eq && k < sizeof keys / sizeof keys[0]; k++)
            if ((size_t)(eq - tok[i]) == strlen(keys[k].key) && !strncmp(tok[i], keys[k].key, (size_t)(eq - tok[i])))
                break;
        if (!eq || k == sizeof keys / sizeof keys[0]) {
            snprintf(out, cap, "error: telemetry: unknown item '%s'", tok[i]);
            return;
        }
        if (parse_ull(eq + 1, 0, keys[k].max, &v[k])) {
            snprintf(out, cap, "error: telemetry: bad value in '%s' (0 to %llu)", tok[i], keys[k].max);
            return;
        }
        set[k] = 1;
    }
    if ((set[13] || set[14]) && (d->unsupported & U_NVLINK)) {
        snprintf(out, cap, "error: telemetry: the GPU has no NVLink (unsupported=nvlink)");
        return;
    }
    /* Energy so far is kept at the old power; from now it grows at the new one. */
    d->energy_mj = set[4] ? v[4] : energy_now(d);
    clock_gettime(CLOCK_MONOTONIC, &d->energy_since);
    if (set[0]) d->util_gpu = (unsigned)v[0];
    if (set[1]) d->util_mem = (unsigned)v[1];
    if (set[2]) d->temp_c = (unsigned)v[2];
    if (set[3]) d->power_mw = (unsigned)v[3];
    if (set[5]) d->sm_mhz = (unsigned)v[5];
    if (set[6]) d->mem_mhz = (unsigned)v[6];
    levels_advance(d);   /* the old reasons and NVLink rates up to now; the new ones from now */
    if (set[7]) d->throttle = v[7];
    if (set[8]) d->pcie_replays = (unsigned)v[8];
    if (set[9]) d->reserved_mib = v[9];
    if (set[10]) d->mem_temp_c = (unsigned)v[10];
    if (set[11]) d->util_enc = (unsigned)v[11];
    if (set[12]) d->util_dec = (unsigned)v[12];
    if (set[13]) d->nvlink_mibps[0] = (double)v[13];
    if (set[14]) d->nvlink_mibps[1] = (double)v[14];
    snprintf(out, cap, "ok");
}

/*
 * "samples <gpu> <pid>:<sm>:<mem>[:<enc>:<dec>][,...] | -": one utilization sample per item, stamped
 * now (CLOCK_REALTIME microseconds, rising on each GPU), as the driver takes one per sample period for
 * each process that used the GPU in it.  "-" forgets them all.
 */
static void ctl_samples(int slot, char *list, char *out, size_t cap)
{
    struct fake_dev *d = &g_devs[slot];
    char *item, *save = NULL;
    int added = 0;
    if (!strcmp(list, "-")) {
        d->nsamples = d->sample_head = 0;
        snprintf(out, cap, "ok");
        return;
    }
    for (item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        unsigned long long f[5] = {0, 0, 0, 0, 0};
        char *part, *psave = NULL;
        int nf = 0;
        struct timespec ts;
        unsigned long long us;
        nvmlProcessUtilizationSample_t *smp;
        for (part = strtok_r(item, ":", &psave); part && nf < 6; part = strtok_r(NULL, ":", &psave), nf++)
            if (nf == 5 || parse_ull(part, 10, nf ? 100 : 0xFFFFFFFFULL, &f[nf]) || (!nf && !f[0])) {
                snprintf(out, cap, "error: samples: want pid:sm:mem[:enc:dec], sm..dec 0-100");
                return;
            }
        if (nf != 3 && nf != 5) {
            snprintf(out, cap, "error: samples: want pid:sm:mem[:enc:dec], sm..dec 0-100");
            return;
        }
        clock_gettime(CLOCK_REALTIME, &ts);
        us = (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
        if (us <= d->last_sample_us)
            us = d->last_sample_us + 1;
        d->last_sample_us = us;
        smp = &g_samples[slot][(d->sample_head + d->nsamples) % SAMPLES_MAX];
        if (d->nsamples == SAMPLES_MAX)
            d->sample_head = (d->sample_head + 1) % SAMPLES_MAX;
        else
            d->nsamples++;
        smp->pid = (unsigned)f[0];
        smp->timeStamp = us;
        smp->smUtil = (unsigned)f[1];
        smp->memUtil = (unsigned)f[2];
        smp->encUtil = (unsigned)f[3];
        smp->decUtil = (unsigned)f[4];
        added++;
    }
    snprintf(out, cap, "ok added=%d last=%llu", added, d->last_sample_us);
}

/* Parses and runs one command (caller holds g_lock); writes the reply to out. */
static void ctl_command(char *line, char *out, size_t cap)
{
    char *tok[64], err[200];
    int n = tokenize(line, tok, 64), slot = -1;
    unsigned long long u, u2;
    long l, l2;
    const char *cmd;
    size_t i;

    if (n <= 0) {
        snprintf(out, cap, "error: %s", n < 0 ? "unterminated quote or too many tokens" : "empty command");
        return;
    }
    cmd = tok[0];
    if (!strcmp(cmd, "ping")) {
        snprintf(out, cap, "ok");
        return;
    }
    if (!strcmp(cmd, "state")) {
        ctl_state(out, cap);
        return;
    }
    if (!strcmp(cmd, "init_error")) {
        if (need_args(n, 2, "init_error <nvmlReturn>", out, cap))
            return;
        if (parse_int(tok[1], 0, 999, &l)) {
            snprintf(out, cap, "error: bad return code '%s'", tok[1]);
            return;
        }
        g_init_error = (nvmlReturn_t)l;
        snprintf(out, cap, "ok");
        return;
    }
    if (!strcmp(cmd, "calls")) {
        if (n == 2 && !strcmp(tok[1], "reset")) {
            for (i = 0; i < N_FUNCS; i++)
                atomic_store_explicit(&g_calls[i], 0, memory_order_relaxed);
            snprintf(out, cap, "ok");
        } else if (n == 1) {
            ctl_calls(out, cap);
        } else {
            snprintf(out, cap, "error: usage: calls [reset]");
        }
        return;
    }
    if (!strcmp(cmd, "wait_error")) {
        struct fake_evset *s;
        if (need_args(n, 3, "wait_error <nvmlReturn> <count>", out, cap))
            return;
        if (parse_int(tok[1], 0, 999, &l) || parse_int(tok[2], -1, LONG_MAX, &l2) || (l == 0 && l2 != 0)) {
            snprintf(out, cap, "error: wait_error: want a code 1-999 and a count (-1: until cleared), 0 0 clears");
            return;
        }
        g_wait_left = l2;
        g_wait_error = l2 ? (nvmlReturn_t)l : NVML_SUCCESS;
        /* Blocked waiters must see it now, not at their timeout. */
        for (s = g_sets; s; s = s->next)
            pthread_cond_broadcast(&s->cond);
        snprintf(out, cap, "ok");
        return;
    }
    if (!strcmp(cmd, "block") || !strcmp(cmd, "release")) {
        ctl_block(!strcmp(cmd, "block"), tok, n, out, cap);
        return;
    }
    if (!strcmp(cmd, "latency")) {
        int row = ANY_GPU;
        if (need_args(n, 3, "latency <gpu>|* <microseconds>", out, cap))
            return;
        if (strcmp(tok[1], "*") && (row = resolve_gpu(tok[1])) < 0) {
            snprintf(out, cap, "error: latency: unknown gpu '%s'", tok[1]);
            return;
        }
        if (parse_int(tok[2], 0, 10000000, &l)) {
            snprintf(out, cap, "error: latency: want microseconds, 0-10000000");
            return;
        }
        g_latency_us[row] = (unsigned)l;
        snprintf(out, cap, "ok");
        return;
    }
    if (!g_loaded) {
        snprintf(out, cap, "error: no scenario loaded yet (nvmlInit has not succeeded)");
        return;
    }
    if (!strcmp(cmd, "add")) {
        int slot = add_gpu(tok + 1, n - 1, 1, err, sizeof err);
        if (slot < 0)
            snprintf(out, cap, "error: add: %s", err);
        else
            snprintf(out, cap, "ok pending %s", g_devs[slot].uuid);
        return;
    }
    if (!strcmp(cmd, "link")) {
        int a, b;
        if (n < 3 || (a = resolve_gpu(tok[1])) < 0 || (b = resolve_gpu(tok[2])) < 0) {
            snprintf(out, cap, "error: usage: link <gpu> <gpu> [nvlink=N] [pcie=LEVEL] with known GPUs");
            return;
        }
        if (parse_link(a, b, tok + 3, n - 3, err, sizeof err))
            snprintf(out, cap, "error: link: %s", err);
        else
            snprintf(out, cap, "ok");
        return;
    }

    /* The remaining commands all take a GPU as the first argument. */
    if (!takes_gpu(cmd)) {
        snprintf(out, cap, "error: unknown command '%s'", cmd);
        return;
    }
    if (n < 2) {
        snprintf(out, cap, "error: %s: missing gpu (index or UUID)", cmd);
        return;
    }
    slot = resolve_gpu(tok[1]);
    if (slot < 0) {
        snprintf(out, cap, "error: %s: unknown gpu '%s'", cmd, tok[1]);
        return;
    }
    struct fake_dev *d = &g_devs[slot];

    if (!strcmp(cmd, "xid") || !strcmp(cmd, "event")) {
        int is_xid = !strcmp(cmd, "xid");
        unsigned long long type = EV_XID, data;
        unsigned gi = 0xFFFFFFFFu, ci = 0xFFFFFFFFu;
        int k = 2;
        if (n != (is_xid ? 3 : 4) && n != (is_xid ? 5 : 6)) {
            snprintf(out, cap, "error: usage: %s", is_xid ? "xid <gpu> <code> [gi ci]"
                                                          : "event <gpu> <hex type> <data> [gi ci]");
            return;
        }
        if (!is_xid && (parse_ull(tok[k++], 16, ~0ULL, &type) || type == 0)) {
            snprintf(out, cap, "error: event: bad type '%s'", tok[2]);
            return;
        }
        if (parse_ull(tok[k], 0, ~0ULL, &data)) {
            snprintf(out, cap, "error: %s: bad number '%s'", cmd, tok[k]);
            return;
        }
        k++;
        if (k < n) {
            if (parse_ull(tok[k], 0, 0xFFFFFFFFULL, &u) || parse_ull(tok[k + 1], 0, 0xFFFFFFFFULL, &u2)) {
                snprintf(out, cap, "error: %s: bad gi/ci", cmd);
                return;
            }
            gi = (unsigned)u;
            ci = (unsigned)u2;
        }
        snprintf(out, cap, "ok queued=%d", deliver(slot, type, data, gi, ci));
    } else if (!strcmp(cmd, "ecc")) {
        /* The counts grow whether or not any event set hears of it, as the driver's do. */
        int dbe;
        l = 1;
        if (n != 3 && n != 4) {
            snprintf(out, cap, "error: usage: ecc <gpu> sbe|dbe [count]");
            return;
        }
        if (strcmp(tok[2], "sbe") && strcmp(tok[2], "dbe")) {
            snprintf(out, cap, "error: ecc: kind must be sbe or dbe, got '%s'", tok[2]);
            return;
        }
        if (n == 4 && parse_int(tok[3], 1, 1 << 20, &l)) {
            snprintf(out, cap, "error: ecc: count must be 1 to %d", 1 << 20);
            return;
        }
        if (d->unsupported & U_ECC) {
            snprintf(out, cap, "error: ecc: the GPU has unsupported=ecc");
            return;
        }
        dbe = !strcmp(tok[2], "dbe");
        d->ecc[dbe][0] += (unsigned long long)l;
        d->ecc[dbe][1] += (unsigned long long)l;
        snprintf(out, cap, "ok queued=%d", deliver(slot, dbe ? EV_DBE : EV_SBE, 0, 0xFFFFFFFFu, 0xFFFFFFFFu));
    } else if (!strcmp(cmd, "lose") || !strcmp(cmd, "remove")) {
        int was_gone = d->lost || d->removed;
        if (need_args(n, 2, "lose|remove <gpu>", out, cap))
            return;
        if (!strcmp(cmd, "lose"))
            d->lost = 1;
        else
            d->removed = 1;
        /* A GPU falling off the bus is reported once, like the real driver. */
        snprintf(out, cap, "ok queued=%d",
                 was_gone ? 0 : deliver(slot, EV_GPU_UNAVAILABLE, 0, 0xFFFFFFFFu, 0xFFFFFFFFu));
    } else if (!strcmp(cmd, "restore")) {
        if (need_args(n, 2, "restore <gpu>", out, cap))
            return;
        if (d->removed) {   /* undoing a remove must not collide with a GPU added since */
            int j;
            for (j = 0; j < g_nslots; j++)
                if (j != slot && !g_devs[j].removed &&
                    (!strcmp(g_devs[j].uuid, d->uuid) || g_devs[j].minor == d->minor)) {
                    snprintf(out, cap, "error: restore: another GPU now has this uuid or minor");
                    return;
                }
        }
        d->lost = d->removed = 0;
        d->pending_pages = d->remap_pending = d->remap_failure = 0;
        d->recovery_action = 0;
        d->ecc[0][0] = d->ecc[1][0] = 0;   /* a reset starts the volatile counts afresh */
        levels_advance(d);                 /* and leaves the GPU idle; retired pages stay retired */
        memset(d->gpm_level, 0, sizeof d->gpm_level);
        memset(d->nvlink_kib, 0, sizeof d->nvlink_kib);   /* its links idle, their counts afresh */
        memset(d->nvlink_mibps, 0, sizeof d->nvlink_mibps);
        snprintf(out, cap, d->visible ? "ok" : "ok pending");
    } else if (!strcmp(cmd, "pending_pages")) {
        if (need_args(n, 3, "pending_pages <gpu> 0|1", out, cap))
            return;
        if (parse_int(tok[2], 0, 1, &l)) {
            snprintf(out, cap, "error: pending_pages: expected 0 or 1");
            return;
        }
        d->pending_pages = (unsigned)l;
        snprintf(out, cap, "ok");
    } else if (!strcmp(cmd, "remap")) {
        long corr = (long)d->corr_rows, unc = (long)d->unc_rows;
        if (n != 4 && n != 6) {
            snprintf(out, cap, "error: usage: remap <gpu> <pending 0|1> <failure 0|1> [corr unc]");
            return;
        }
        if (parse_int(tok[2], 0, 1, &l) || parse_int(tok[3], 0, 1, &l2) ||
            (n == 6 && (parse_int(tok[4], 0, 1 << 20, &corr) || parse_int(tok[5], 0, 1 << 20, &unc)))) {
            snprintf(out, cap, "error: remap: bad value");
            return;
        }
        d->remap_pending = (unsigned)l;
        d->remap_failure = (unsigned)l2;
        d->corr_rows = (unsigned)corr;
        d->unc_rows = (unsigned)unc;
        snprintf(out, cap, "ok");
    } else if (!strcmp(cmd, "telemetry")) {
        ctl_telemetry(d, tok, n, out, cap);
    } else if (!strcmp(cmd, "retire")) {
        ctl_retire(d, tok, n, out, cap);
    } else if (!strcmp(cmd, "gpm")) {
        ctl_gpm(d, tok, n, out, cap);
    } else if (!strcmp(cmd, "samples")) {
        if (need_args(n, 3, "samples <gpu> <pid>:<sm>:<mem>[:<enc>:<dec>][,...] | -", out, cap))
            return;
        ctl_samples(slot, tok[2], out, cap);
    } else if (!strcmp(cmd, "procs")) {
        struct fake_proc procs[PROCS_MAX];
        int np;
        if (need_args(n, 3, "procs <gpu> <pid>[:<mib>][:<kind>][@<gi>/<ci>][,...] | -", out, cap))
            return;
        np = parse_procs(tok[2], procs, err, sizeof err);
        cm_sync();
        if (np < 0 || procs_check_mig(d, procs, np, err, sizeof err) ||
            procs_check_mode(d, cm_of(d), procs, np, err, sizeof err)) {
            snprintf(out, cap, "error: procs: %s", err);
            return;
        }
        memcpy(d->procs, procs, (size_t)np * sizeof procs[0]);
        d->nprocs = np;
        snprintf(out, cap, "ok");
    } else if (!strcmp(cmd, "compute_mode")) {
        int mode;
        if (n != 2 && n != 3) {
            snprintf(out, cap, "error: usage: compute_mode <gpu> "
                               "[0-3|DEFAULT|EXCLUSIVE_THREAD|PROHIBITED|EXCLUSIVE_PROCESS]");
            return;
        }
        if (d->unsupported & U_COMPUTE_MODE) {
            snprintf(out, cap, "error: compute_mode: the GPU has unsupported=compute_mode");
            return;
        }
        cm_sync();
        if (n == 2) {
            snprintf(out, cap, "ok %d", cm_of(d));
            return;
        }
        if (parse_cm(tok[2], &mode)) {
            snprintf(out, cap, "error: compute_mode: bad mode '%s' (0-3 or a name)", tok[2]);
            return;
        }
        if (d->lost || d->removed) {   /* what nvidia-smi -c gets from NVML then */
            snprintf(out, cap, "error: compute_mode: the GPU is lost");
            return;
        }
        if (d->mig_mode) {
            snprintf(out, cap, "error: compute_mode: not supported on a GPU in MIG mode");
            return;
        }
        if (cm_store(d->uuid, mode)) {
            snprintf(out, cap, "error: compute_mode: cannot record it in the driver state file");
            return;
        }
        snprintf(out, cap, "ok");
    } else if (!strcmp(cmd, "mig")) {
        if (n == 4 && !strcmp(tok[2], "mode")) {
            if (parse_int(tok[3], 0, 1, &l)) {
                snprintf(out, cap, "error: mig: mode must be 0 or 1");
                return;
            }
            if (l && (d->unsupported & U_MIG)) {
                snprintf(out, cap, "error: mig: the GPU has unsupported=mig");
                return;
            }
            d->mig_mode = (int)l;
            if (!l)
                mig_clear(d);
        } else if (n == 4 && !strcmp(tok[2], "layout")) {
            int prof[MIG_PER_GPU], np = 0, k;
            unsigned slices = 0;
            char *save = NULL, *item;
            if (!d->mig_mode) {
                snprintf(out, cap, "error: mig: MIG mode is off on this GPU");
                return;
            }
            if (strcmp(tok[3], "-")) {
                for (item = strtok_r(tok[3], ",", &save); item; item = strtok_r(NULL, ",", &save)) {
                    int p = profile_index(item);
                    if (p < 0) {
                        snprintf(out, cap, "error: mig: unknown MIG profile '%s'", item);
                        return;
                    }
                    slices += mig_profiles[p].slices;
                    if (slices > MIG_PER_GPU) {
                        snprintf(out, cap, "error: mig: layout over %d slices", MIG_PER_GPU);
                        return;
                    }
                    prof[np++] = p;
                }
            }
            mig_clear(d);
            for (k = 0; k < np; k++)
                if (mig_add(slot, prof[k], -1, 0, NULL, err, sizeof err)) {   /* e.g. a clashing uuid= */
                    mig_clear(d);
                    snprintf(out, cap, "error: mig: %s (layout cleared)", err);
                    return;
                }
        } else {
            snprintf(out, cap, "error: usage: mig <gpu> mode 0|1 | mig <gpu> layout <profile>[,<profile>...]|-");
            return;
        }
        snprintf(out, cap, "ok queued=%d", deliver(slot, EV_MIG_CONFIG, 0, ID_ANY, ID_ANY));
    } else {   /* recovery_action */
        if (need_args(n, 3, "recovery_action <gpu> <n>", out, cap))
            return;
        if (parse_int(tok[2], 0, 0xFFFF, &l)) {
            snprintf(out, cap, "error: recovery_action: bad value '%s'", tok[2]);
            return;
        }
        d->recovery_action = (unsigned)l;
        /* Real drivers announce a new recovery action with this event. */
        snprintf(out, cap, "ok queued=%d",
                 deliver(slot, EV_RECOVERY_ACTION, (unsigned long long)l, 0xFFFFFFFFu, 0xFFFFFFFFu));
    }
}

/* ---- the journal: what the owner changed, for its children ----------------------- */

static int g_journal_fd = -1;   /* the owner's, append only */
static int g_follow_fd = -1;    /* a child's: the journal it follows */
static off_t g_follow_off;      /* how much of it the child has applied */

static int journal_path(char *out, size_t cap)
{
    const char *ctl = getenv("FAKE_NVML_CONTROL");
    if (!ctl || !*ctl || (size_t)snprintf(out, cap, "%s.journal", ctl) >= cap)
        return -1;
    return 0;
}

/*
 * The command as a child must run it (caller holds g_lock): a GPU given by
 * index in the owner's enumeration, which a child's need not match, by UUID.
 * Writes line to out unchanged where there is nothing to resolve.
 */
static void canonical_command(const char *line, char *out, size_t cap)
{
    char copy[65536], *tok[64];
    const char *uuid[3] = {NULL, NULL, NULL};
    size_t off[3] = {0, 0, 0}, len[3] = {0, 0, 0}, at = 0;
    int n, i, last = 1;
    long idx;
    snprintf(out, cap, "%s", line);
    if (strlen(line) >= sizeof copy || strchr(line, '"'))
        return;   /* quotes move the tokens: only add lines have them, and they name no GPU */
    memcpy(copy, line, strlen(line) + 1);
    n = tokenize(copy, tok, 64);
    if (n < 2)
        return;
    if (!strcmp(tok[0], "link"))
        last = 2;
    else if (!takes_gpu(tok[0]) && strcmp(tok[0], "latency") && strcmp(tok[0], "block") && strcmp(tok[0], "release"))
        return;
    for (i = 1; i <= last && i < n; i++)
        if (parse_int(tok[i], 0, MAX_GPUS - 1, &idx) == 0 && idx < g_count) {
            uuid[i] = g_devs[g_order[idx]].uuid;
            off[i] = (size_t)(tok[i] - copy);
            len[i] = strlen(tok[i]);
        }
    if (!uuid[1] && !uuid[2])
        return;
    out[0] = 0;
    for (i = 1; i <= 2; i++)
        if (uuid[i]) {
            snprintf(out + strlen(out), cap - strlen(out), "%.*s%s", (int)(off[i] - at), line + at, uuid[i]);
            at = off[i] + len[i];
        }
    snprintf(out + strlen(out), cap - strlen(out), "%s", line + at);
}

/* The owner: a command that changed state, for its children (caller holds g_lock). */
static void journal_write(const char *command, const char *reply)
{
    char cmd[32] = "", entry[65600];
    int k;
    if (g_journal_fd < 0 || strncmp(reply, "ok", 2))
        return;
    sscanf(command, "%31s", cmd);
    if (!strcmp(cmd, "ping") || !strcmp(cmd, "state") || !strcmp(cmd, "calls"))
        return;
    /* An add names its GPU as the owner made it: a child's free slots, and so its default UUID, differ. */
    if (!strcmp(cmd, "add") && !strstr(command, " uuid=") && !strncmp(reply, "ok pending ", 11))
        k = snprintf(entry, sizeof entry, "%s uuid=%s\n", command, reply + 11);
    else
        k = snprintf(entry, sizeof entry, "%s\n", command);
    if (k > 0 && (size_t)k < sizeof entry && write(g_journal_fd, entry, (size_t)k) != k)
        fprintf(stderr, "fakenvml: journal: %s\n", strerror(errno));
}

/* The owner, once its socket is bound: a journal of its own from now. */
static void journal_start(void)
{
    char path[PATH_MAX], head[40];
    int k;
    if (journal_path(path, sizeof path))
        return;
    g_journal_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
    if (g_journal_fd < 0) {
        fprintf(stderr, "fakenvml: journal %s: %s\n", path, strerror(errno));
        return;
    }
    k = snprintf(head, sizeof head, "owner %d\n", (int)getpid());
    if (write(g_journal_fd, head, (size_t)k) != k)
        fprintf(stderr, "fakenvml: journal %s: %s\n", path, strerror(errno));
}

/* A child: the journal's lines it has not applied yet, whole lines only (caller holds g_lock, g_loaded). */
static void follow_apply(void)
{
    static char buf[1 << 17], reply[65536];
    for (;;) {
        ssize_t n = pread(g_follow_fd, buf, sizeof buf - 1, g_follow_off);
        char *line = buf, *nl;
        if (n <= 0)
            return;
        buf[n] = 0;
        while ((nl = strchr(line, '\n'))) {
            size_t used = (size_t)(nl - line) + 1;
            *nl = 0;
            ctl_command(line, reply, sizeof reply);
            if (strncmp(reply, "ok", 2))
                fprintf(stderr, "fakenvml: following the journal: %s\n", reply);
            g_follow_off += (off_t)used;
            line = nl + 1;
        }
        if (line == buf)
            return;   /* a line still being written */
    }
}

static void *follow_main(void *arg)
{
    int ifd = (int)(intptr_t)arg;
    char events[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        if (read(ifd, events, sizeof events) < 0 && errno != EINTR)
            return NULL;
        pthread_mutex_lock(&g_lock);
        if (g_loaded)   /* else the first nvmlInit applies it all */
            follow_apply();
        pthread_mutex_unlock(&g_lock);
    }
}

/* Follow the journal if our parent owns it; 0: following (no control socket for us). */
static int follow_start(void)
{
    char path[PATH_MAX], head[40] = "";
    ssize_t n;
    long owner;
    int fd, ifd;
    pthread_attr_t attr;
    pthread_t th;
    sigset_t all, old;
    if (journal_path(path, sizeof path) || (fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return -1;
    n = read(fd, head, sizeof head - 1);
    head[n > 0 ? n : 0] = 0;
    if (sscanf(head, "owner %ld", &owner) != 1 || owner != (long)getppid() || !strchr(head, '\n')) {
        close(fd);
        return -1;
    }
    /* Watched before the first read, so that no line written in between goes unseen. */
    ifd = inotify_init1(IN_CLOEXEC);
    if (ifd < 0 || inotify_add_watch(ifd, path, IN_MODIFY) < 0) {
        fprintf(stderr, "fakenvml: cannot follow %s: %s\n", path, strerror(errno));
        if (ifd >= 0)
            close(ifd);
        close(fd);
        return -1;
    }
    g_follow_fd = fd;
    g_follow_off = (off_t)(strchr(head, '\n') - head) + 1;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &attr, follow_main, (void *)(intptr_t)ifd) != 0)
        fprintf(stderr, "fakenvml: cannot start the journal's thread\n");
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return 0;
}

static void *ctl_main(void *arg)
{
    int fd = (int)(intptr_t)arg;
    for (;;) {
        /* One control thread: a procs line of hundreds; a GPU index made a UUID takes room. */
        static char buf[65536], command[65536 + 128], reply[65536];
        struct sockaddr_un from;
        socklen_t fl = sizeof from;
        struct pollfd p = {fd, POLLIN, 0};
        ssize_t n;
        if (poll(&p, 1, -1) < 0)
            continue;
        memset(&from, 0, sizeof from);
        n = recvfrom(fd, buf, sizeof buf - 1, 0, (struct sockaddr *)&from, &fl);
        if (n < 0)
            continue;
        buf[n] = 0;
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
            buf[--n] = 0;
        pthread_mutex_lock(&g_lock);
        canonical_command(buf, command, sizeof command);   /* before tokenizing mangles buf */
        ctl_command(buf, reply, sizeof reply);
        journal_write(command, reply);
        pthread_mutex_unlock(&g_lock);
        /* Unbound senders cannot receive; the fd is non-blocking so a slow client never stalls us. */
        if (fl > (socklen_t)sizeof(sa_family_t))
            (void)sendto(fd, reply, strlen(reply), 0, (struct sockaddr *)&from, fl);
    }
    return NULL;
}

static void ctl_start(void)
{
    const char *path = getenv("FAKE_NVML_CONTROL");
    struct sockaddr_un sa;
    pthread_attr_t attr;
    pthread_t th;
    sigset_t all, old;
    int fd;
    if (!path || !*path)
        return;
    if (strlen(path) >= sizeof sa.sun_path) {
        fprintf(stderr, "fakenvml: control socket path too long: %s\n", path);
        return;
    }
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    if (fd < 0) {
        fprintf(stderr, "fakenvml: control socket: %s\n", strerror(errno));
        return;
    }
    /* Keep the fd out of exec'd children and never block the server on a reply. */
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    unlink(path);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        fprintf(stderr, "fakenvml: bind %s: %s\n", path, strerror(errno));
        close(fd);
        return;
    }
    journal_start();
    /* The host's signals (Python's SIGINT etc.) must land on its own threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &attr, ctl_main, (void *)(intptr_t)fd) != 0) {
        fprintf(stderr, "fakenvml: cannot start control thread\n");
        close(fd);
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* A fork taken while another thread holds g_lock would deadlock the child. */
static void fork_prepare(void) { pthread_mutex_lock(&g_lock); }
static void fork_release(void) { pthread_mutex_unlock(&g_lock); }

/* Monotonic waits: a wall-clock jump must not stretch or cut a timeout. */
static void set_cond_init(struct fake_evset *s)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cond, &ca);
    pthread_condattr_destroy(&ca);
}

/*
 * The child has only the forking thread: callers blocked in the parent are
 * not there, and a condition variable that still counts them could stall a
 * broadcast, so it starts afresh.  The blocks themselves stay set.
 */
static void fork_child(void)
{
    struct fake_evset *s;
    pthread_cond_init(&g_block_cond, NULL);
    memset(g_block_waiters, 0, sizeof g_block_waiters);
    /* Nor are the parent's event waiters, which a shutdown here would wait for forever. */
    pthread_cond_init(&g_waits_done, NULL);
    g_waiting = g_shutting_down = g_latency_waiting = 0;
    for (s = g_sets; s; s = s->next) {
        s->waiters = 0;
        set_cond_init(s);   /* destroying one that counts absent waiters would wait for them */
    }
    pthread_mutex_unlock(&g_lock);
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void once_init(void)
{
    pthread_atfork(fork_prepare, fork_release, fork_child);
    if (follow_start())
        ctl_start();
}

/* ---- exported: init and system ------------------------------------------------ */

static nvmlReturn_t init_common(void)
{
    pthread_once(&g_once, once_init);   /* before any block: "release" needs the control thread */
    pthread_mutex_lock(&g_lock);
    block_point(-1);
    if (!g_loaded) {
        if (load_scenario())
            return done(NVML_ERROR_UNKNOWN);
        g_loaded = 1;
        if (g_follow_fd >= 0)
            follow_apply();
    }
    if (g_init_error)
        return done(g_init_error);
    if (g_refcount++ == 0)
        apply_pending();
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    COUNT(nvmlInitWithFlags);
    (void)flags;
    return init_common();
}

nvmlReturn_t nvmlInit_v2(void)
{
    COUNT(nvmlInit_v2);
    return init_common();
}

nvmlReturn_t nvmlInit(void)
{
    COUNT(nvmlInit);
    return init_common();
}

static void set_release(struct fake_evset *s);

nvmlReturn_t nvmlShutdown(void)
{
    struct fake_evset *s;
    int waited = 0;
    COUNT(nvmlShutdown);
    pthread_mutex_lock(&g_lock);
    block_point(-1);
    if (g_refcount == 0)
        return done(NVML_ERROR_UNINITIALIZED);
    /* The last reference waits out the event waits in progress (g_waiting, above); an nvmlInit
     * meanwhile makes it not the last. */
    while (g_refcount == 1 && g_waiting) {
        waited = 1;
        g_shutting_down = 1;
        pthread_cond_wait(&g_waits_done, &g_lock);
    }
    g_shutdown_waits += (unsigned long long)waited;
    g_shutting_down = 0;
    if (--g_refcount == 0) {
        /* A full shutdown releases every event set, as NVML does; nothing waits on one now. */
        while ((s = g_sets) != NULL) {
            g_sets = s->next;
            set_release(s);
        }
    }
    pthread_cond_broadcast(&g_waits_done);   /* waits that started meanwhile fail now */
    return done(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Ran out of critical resources, other than memory";
    case 24: return "The requested frequency is not supported";
    case 25: return "The provided version is invalid/unsupported";
    case 26: return "The requested functionality has been deprecated";
    case 27: return "The system is not ready for the request";
    case 28: return "The GPU was not found";
    case 29: return "The resource is in an invalid state";
    case 999: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* Locks for a call that takes no device; a "*" block holds it here, before the refcount check. */
static nvmlReturn_t sys_begin(void)
{
    pthread_mutex_lock(&g_lock);
    block_point(-1);
    return g_refcount ? NVML_SUCCESS : done(NVML_ERROR_UNINITIALIZED);
}

static nvmlReturn_t put_str(char *buf, unsigned int len, const char *s)
{
    size_t n = strlen(s);
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((size_t)len < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, n + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    COUNT(nvmlSystemGetDriverVersion);
    nvmlReturn_t rc = sys_begin();
    return rc ? rc : done(put_str(version, length, g_driver));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    COUNT(nvmlSystemGetNVMLVersion);
    nvmlReturn_t rc = sys_begin();
    return rc ? rc : done(put_str(version, length, g_nvml));
}

static nvmlReturn_t cuda_version(int *v)
{
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    if (!v)
        return done(NVML_ERROR_INVALID_ARGUMENT);
    *v = g_cuda;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    COUNT(nvmlSystemGetCudaDriverVersion);
    return cuda_version(v);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    COUNT(nvmlSystemGetCudaDriverVersion_v2);
    return cuda_version(v);
}

/* ---- exported: enumeration ------------------------------------------------------ */

static nvmlReturn_t device_count(unsigned int *count)
{
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    if (!count)
        return done(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned)g_count;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    COUNT(nvmlDeviceGetCount_v2);
    return device_count(count);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    COUNT(nvmlDeviceGetCount);
    return device_count(count);
}

/*
 * Lookups hand out handles of lost GPUs too: the caller learns of the loss on
 * first use.  A block on the GPU a lookup finds holds it (lookup_blocked);
 * released, the lookup starts over, so it answers for the enumeration of then.
 */
static nvmlReturn_t handle_by_index(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc;
    do {
        if ((rc = sys_begin()))
            return rc;
        if (!device || index >= (unsigned)g_count)
            return done(NVML_ERROR_INVALID_ARGUMENT);
    } while (lookup_blocked(g_order[index]));
    *device = &g_devs[g_order[index]];
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    COUNT(nvmlDeviceGetHandleByIndex_v2);
    return handle_by_index(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    COUNT(nvmlDeviceGetHandleByIndex);
    return handle_by_index(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlDevice_t found;
    nvmlReturn_t rc;
    int i, slot;
    COUNT(nvmlDeviceGetHandleByUUID);
    do {
        if ((rc = sys_begin()))
            return rc;
        if (!uuid || !device)
            return done(NVML_ERROR_INVALID_ARGUMENT);
        found = NULL;
        slot = -1;
        for (i = 0; i < g_count && !found; i++)
            if (!strcmp(g_devs[g_order[i]].uuid, uuid))
                found = &g_devs[slot = g_order[i]];
        for (i = 0; i < MIG_SLOTS && !found; i++)   /* MIG devices of the GPUs enumerated now */
            if (g_migs[i].used && g_devs[g_migs[i].parent].visible && !strcmp(g_migs[i].uuid, uuid)) {
                found = (nvmlDevice_t)(void *)&g_migs[i];
                slot = g_migs[i].parent;
            }
    } while (lookup_blocked(slot));
    if (!found)
        return done(NVML_ERROR_NOT_FOUND);
    *device = found;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *device)
{
    nvmlReturn_t rc;
    int i, slot;
    COUNT(nvmlDeviceGetHandleBySerial);
    do {
        if ((rc = sys_begin()))
            return rc;
        if (!serial || !device)
            return done(NVML_ERROR_INVALID_ARGUMENT);
        for (i = 0, slot = -1; i < g_count && slot < 0; i++)
            if (!strcmp(g_devs[g_order[i]].serial, serial))
                slot = g_order[i];
    } while (lookup_blocked(slot));
    if (slot < 0)
        return done(NVML_ERROR_NOT_FOUND);
    *device = &g_devs[slot];
    return done(NVML_SUCCESS);
}

static nvmlReturn_t handle_by_bus(const char *pciBusId, nvmlDevice_t *device)
{
    nvmlReturn_t rc;
    unsigned dom, bus, dev, fn;
    int i, slot;
    do {
        if ((rc = sys_begin()))
            return rc;
        if (!pciBusId || !device || parse_busid(pciBusId, &dom, &bus, &dev, &fn))
            return done(NVML_ERROR_INVALID_ARGUMENT);
        for (i = 0, slot = -1; i < g_count && slot < 0; i++) {
            const struct fake_dev *d = &g_devs[g_order[i]];
            if (d->domain == dom && d->bus == bus && d->devno == dev && d->func == fn)
                slot = g_order[i];
        }
    } while (lookup_blocked(slot));
    if (slot < 0)
        return done(NVML_ERROR_NOT_FOUND);
    *device = &g_devs[slot];
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    COUNT(nvmlDeviceGetHandleByPciBusId_v2);
    return handle_by_bus(pciBusId, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    COUNT(nvmlDeviceGetHandleByPciBusId);
    return handle_by_bus(pciBusId, device);
}

/* ---- exported: per-device queries ----------------------------------------------- */

static int slot_of(const void *h)
{
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_devs;
    if (p < base || p >= base + sizeof g_devs || (p - base) % sizeof(struct fake_dev))
        return -1;
    return (int)((p - base) / sizeof(struct fake_dev));
}

static int mig_of(const void *h)
{
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_migs;
    if (p < base || p >= base + sizeof g_migs || (p - base) % sizeof(struct fake_mig))
        return -1;
    return (int)((p - base) / sizeof(struct fake_mig));
}

static int gone(const struct fake_dev *d)
{
    return d->lost || d->removed || !d->visible;
}

/*
 * Locks and validates a handle, a GPU's or a MIG device's.  On success
 * returns NVML_SUCCESS with g_lock held (release it with done()), *out the
 * GPU (a MIG device's parent) and *mig the MIG device or NULL; on failure
 * g_lock is already released.  A block on the parent GPU holds it here.
 */
static nvmlReturn_t any_begin(nvmlDevice_t h, struct fake_dev **out, struct fake_mig **mig)
{
    int m;
    pthread_mutex_lock(&g_lock);
    do {
        if (!g_refcount)
            return done(NVML_ERROR_UNINITIALIZED);
        m = mig_of(h);
        if (m < 0) {
            *mig = NULL;
            pthread_mutex_unlock(&g_lock);
            return NVML_ERROR_NOT_FOUND;   /* internal: not a MIG handle, caller goes on with dev_begin */
        }
        if (!g_migs[m].used)
            return done(NVML_ERROR_INVALID_ARGUMENT);   /* removed by a layout change */
        if (gone(&g_devs[g_migs[m].parent]))
            return done(NVML_ERROR_GPU_IS_LOST);
    } while (block_point(g_migs[m].parent));
    *out = &g_devs[g_migs[m].parent];
    *mig = &g_migs[m];
    return NVML_SUCCESS;
}

/*
 * Locks and validates a GPU handle.  On success returns NVML_SUCCESS with
 * g_lock held (release it with done()); on failure g_lock is already
 * released.  MIG handles get NOT_SUPPORTED (or their own errors).  A block on
 * the GPU holds it here, once the handle checks out.
 */
static nvmlReturn_t dev_begin(nvmlDevice_t h, struct fake_dev **out)
{
    int s;
    pthread_mutex_lock(&g_lock);
    do {
        if (!g_refcount)
            return done(NVML_ERROR_UNINITIALIZED);
        if ((s = mig_of(h)) >= 0) {
            if (!g_migs[s].used)
                return done(NVML_ERROR_INVALID_ARGUMENT);
            return done(gone(&g_devs[g_migs[s].parent]) ? NVML_ERROR_GPU_IS_LOST : NVML_ERROR_NOT_SUPPORTED);
        }
        s = slot_of(h);
        if (s < 0 || s >= g_nslots || !g_devs[s].ever_visible)
            return done(NVML_ERROR_INVALID_ARGUMENT);
        if (gone(&g_devs[s]))
            return done(NVML_ERROR_GPU_IS_LOST);
    } while (block_point(s));
    *out = &g_devs[s];
    return NVML_SUCCESS;
}

/* A GPU or a MIG handle: m is the MIG device or NULL, d the GPU (a MIG device's parent). */
static nvmlReturn_t either_begin(nvmlDevice_t h, struct fake_dev **d, struct fake_mig **m)
{
    nvmlReturn_t rc = any_begin(h, d, m);
    return rc == NVML_ERROR_NOT_FOUND ? dev_begin(h, d) : rc;
}

#define DEV_BEGIN(h)                                   \
    struct fake_dev *d;                                \
    do {                                               \
        nvmlReturn_t r_ = dev_begin((h), &d);          \
        if (r_ != NVML_SUCCESS)                        \
            return r_;                                 \
    } while (0)

#define ANY_BEGIN(h)                                   \
    struct fake_dev *d;                                \
    struct fake_mig *mig;                              \
    do {                                               \
        nvmlReturn_t r_ = either_begin((h), &d, &mig); \
        if (r_ != NVML_SUCCESS)                        \
            return r_;                                 \
    } while (0)

#define REQUIRE(cond)                                  \
    do {                                               \
        if (!(cond))                                   \
            return done(NVML_ERROR_INVALID_ARGUMENT);  \
    } while (0)

#define SUPPORTED(bit)                                 \
    do {                                               \
        if (d->unsupported & (bit))                    \
            return done(NVML_ERROR_NOT_SUPPORTED);     \
    } while (0)

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    COUNT(nvmlDeviceGetIndex);
    DEV_BEGIN(device);
    REQUIRE(index);
    *index = (unsigned)index_of((int)(d - g_devs));
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    COUNT(nvmlDeviceGetUUID);
    ANY_BEGIN(device);
    return done(put_str(uuid, length, mig ? mig->uuid : d->uuid));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    char mig_name[160];
    COUNT(nvmlDeviceGetName);
    ANY_BEGIN(device);
    SUPPORTED(U_NAME);
    if (!mig)
        return done(put_str(name, length, d->name));
    /* As the driver names them: "NVIDIA H100 80GB HBM3 MIG 1g.10gb". */
    snprintf(mig_name, sizeof mig_name, "%s MIG %s", d->name, mig_profiles[mig->profile].name);
    return done(put_str(name, length, mig_name));
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    COUNT(nvmlDeviceGetSerial);
    DEV_BEGIN(device);
    SUPPORTED(U_SERIAL);
    return done(put_str(serial, length, d->serial));
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    COUNT(nvmlDeviceGetMinorNumber);
    DEV_BEGIN(device);
    REQUIRE(minorNumber);
    SUPPORTED(U_MINOR);
    *minorNumber = d->minor;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *type)
{
    COUNT(nvmlDeviceGetBrand);
    DEV_BEGIN(device);
    REQUIRE(type);
    *type = NVML_BRAND_NVIDIA;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    COUNT(nvmlDeviceGetArchitecture);
    DEV_BEGIN(device);
    REQUIRE(arch);
    switch (d->cc_major) {
    case 3: *arch = 2; break;                                /* Kepler */
    case 5: *arch = 3; break;                                /* Maxwell */
    case 6: *arch = 4; break;                                /* Pascal */
    case 7: *arch = d->cc_minor >= 5 ? 6 : 5; break;         /* Turing / Volta */
    case 8: *arch = d->cc_minor == 9 ? 8 : 7; break;         /* Ada / Ampere */
    case 9: *arch = 9; break;                                /* Hopper */
    case 10: case 12: *arch = 10; break;                     /* Blackwell */
    default: *arch = 0xFFFFFFFFu; break;
    }
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode)
{
    COUNT(nvmlDeviceGetPersistenceMode);
    DEV_BEGIN(device);
    REQUIRE(mode);
    SUPPORTED(U_PERSISTENCE);
    *mode = NVML_FEATURE_ENABLED;   /* what a managed server node runs with */
    return done(NVML_SUCCESS);
}

/*
 * Compute mode: driver state (cm_of), see the header comment.  MIG handles
 * get NOT_SUPPORTED (dev_begin), as from the R550 driver this fake reports;
 * a GPU in MIG mode reads its mode but cannot change it.
 */
nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode)
{
    COUNT(nvmlDeviceGetComputeMode);
    DEV_BEGIN(device);
    REQUIRE(mode);
    SUPPORTED(U_COMPUTE_MODE);
    cm_sync();
    *mode = cm_of(d);
    return done(NVML_SUCCESS);
}

/*
 * Checks in the order NVML and RM make them: the mode (EXCLUSIVE_THREAD's
 * support is removed), root, MIG mode (RM: NV_ERR_NOT_SUPPORTED while MIG is
 * enabled).  Processes running now do not matter: RM only records the rule,
 * which applies to contexts created later.
 */
nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, int mode)
{
    COUNT(nvmlDeviceSetComputeMode);
    DEV_BEGIN(device);
    REQUIRE(mode == NVML_COMPUTEMODE_DEFAULT || mode == NVML_COMPUTEMODE_PROHIBITED ||
            mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS);
    SUPPORTED(U_COMPUTE_MODE);
    if (geteuid() != 0)
        return done(NVML_ERROR_NO_PERMISSION);
    if (d->mig_mode)
        return done(NVML_ERROR_NOT_SUPPORTED);
    return done(cm_store(d->uuid, mode) ? NVML_ERROR_UNKNOWN : NVML_SUCCESS);
}

static void fill_pci(const struct fake_dev *d, nvmlPciInfo_t *p)
{
    memset(p, 0, sizeof *p);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%04X:%02X:%02X.%X", d->domain & 0xFFFF, d->bus,
             d->devno, d->func);
    snprintf(p->busId, sizeof p->busId, "%08X:%02X:%02X.%X", d->domain, d->bus, d->devno, d->func);
    p->domain = d->domain;
    p->bus = d->bus;
    p->device = d->devno;
    p->pciDeviceId = d->pci_device_id;
    p->pciSubSystemId = d->pci_subsystem_id;
}

/* The legacy struct's 16-byte busId only has room for the 4-digit domain form. */
static void fill_pci_legacy(const nvmlPciInfo_t *src, nvmlPciInfoLegacy_t *p)
{
    memcpy(p->busId, src->busIdLegacy, sizeof p->busId);
    p->domain = src->domain;
    p->bus = src->bus;
    p->device = src->device;
    p->pciDeviceId = src->pciDeviceId;
    p->pciSubSystemId = src->pciSubSystemId;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    COUNT(nvmlDeviceGetPciInfo_v3);
    DEV_BEGIN(device);
    REQUIRE(pci);
    fill_pci(d, pci);
    return done(NVML_SUCCESS);
}

static nvmlReturn_t pci_info_legacy(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    nvmlPciInfo_t full;
    DEV_BEGIN(device);
    REQUIRE(pci);
    fill_pci(d, &full);
    fill_pci_legacy(&full, pci);
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    COUNT(nvmlDeviceGetPciInfo_v2);
    return pci_info_legacy(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    COUNT(nvmlDeviceGetPciInfo);
    return pci_info_legacy(device, pci);
}

static int proc_listed(const struct fake_proc *p, unsigned kind, const struct fake_mig *mig);

/* Used: what the driver keeps (the GPU's, or a MIG device's share of it) and what its processes use. */
static unsigned long long fb_used(const struct fake_dev *d, const struct fake_mig *mig, unsigned long long total)
{
    unsigned long long used = mig ? 0 : d->reserved_mib << 20;
    int i;
    for (i = 0; i < d->nprocs; i++)
        if (proc_listed(&d->procs[i], K_COMPUTE | K_GRAPHICS | K_MPS, mig) && d->procs[i].mem != NVML_VALUE_NOT_AVAILABLE_ULL)
            used += d->procs[i].mem;
    return used < total ? used : total;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    COUNT(nvmlDeviceGetMemoryInfo);
    ANY_BEGIN(device);
    REQUIRE(memory);
    SUPPORTED(U_MEMORY);
    memory->total = (mig ? mig_profiles[mig->profile].memory_mb : d->memory_mib) << 20;
    memory->used = fb_used(d, mig, memory->total);
    memory->free = memory->total - memory->used;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    COUNT(nvmlDeviceGetMemoryInfo_v2);
    ANY_BEGIN(device);
    REQUIRE(memory);
    SUPPORTED(U_MEMORY);
    if (memory->version != NVML_MEMORY_V2)
        return done(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = (mig ? mig_profiles[mig->profile].memory_mb : d->memory_mib) << 20;
    memory->reserved = 0;
    memory->used = fb_used(d, mig, memory->total);
    memory->free = memory->total - memory->used;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    COUNT(nvmlDeviceGetCudaComputeCapability);
    DEV_BEGIN(device);
    REQUIRE(major && minor);
    SUPPORTED(U_CC);
    *major = d->cc_major;
    *minor = d->cc_minor;
    return done(NVML_SUCCESS);
}

/* Real NVML declares unsigned int *; -1 (no NUMA affinity) reads back as -1 through pynvml's c_int. */
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, int *node)
{
    COUNT(nvmlDeviceGetNumaNodeId);
    DEV_BEGIN(device);
    REQUIRE(node);
    SUPPORTED(U_NUMA);
    *node = d->numa;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    COUNT(nvmlDeviceGetMigMode);
    DEV_BEGIN(device);
    REQUIRE(currentMode && pendingMode);
    SUPPORTED(U_MIG);
    *currentMode = *pendingMode = (unsigned)d->mig_mode;   /* mode changes here apply at once */
    return done(NVML_SUCCESS);
}

/* "Returns zero if MIG is not supported or enabled." */
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    COUNT(nvmlDeviceGetMaxMigDeviceCount);
    DEV_BEGIN(device);
    REQUIRE(count);
    *count = d->mig_mode ? MIG_PER_GPU : 0;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    COUNT(nvmlDeviceIsMigDeviceHandle);
    ANY_BEGIN(device);
    REQUIRE(isMigDevice);
    *isMigDevice = mig != NULL;
    return done(NVML_SUCCESS);
}

/*
 * Indices run over the GPU's current MIG devices (dense, in layout order);
 * index < max count but past the last one: NOT_FOUND; index >= max count
 * (always, with MIG off): INVALID_ARGUMENT, as nvml.h documents.
 */
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
    COUNT(nvmlDeviceGetMigDeviceHandleByIndex);
    DEV_BEGIN(device);
    REQUIRE(migDevice);
    SUPPORTED(U_MIG);
    REQUIRE(d->mig_mode && index < MIG_PER_GPU);
    if (index >= (unsigned)d->nmig)
        return done(NVML_ERROR_NOT_FOUND);
    *migDevice = (nvmlDevice_t)(void *)&g_migs[d->mig[index]];
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    COUNT(nvmlDeviceGetDeviceHandleFromMigDeviceHandle);
    ANY_BEGIN(migDevice);
    REQUIRE(device && mig);
    *device = d;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    COUNT(nvmlDeviceGetGpuInstanceId);
    ANY_BEGIN(device);
    REQUIRE(id);
    if (!mig)
        return done(NVML_ERROR_NOT_SUPPORTED);
    *id = mig->gi;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    COUNT(nvmlDeviceGetComputeInstanceId);
    ANY_BEGIN(device);
    REQUIRE(id);
    if (!mig)
        return done(NVML_ERROR_NOT_SUPPORTED);
    *id = mig->ci;
    return done(NVML_SUCCESS);
}

/* nvml.h: "This API currently only supports MIG device handles." */
static nvmlReturn_t attributes(nvmlDevice_t device, nvmlDeviceAttributes_t *a)
{
    const struct mig_profile *p;
    ANY_BEGIN(device);
    REQUIRE(a);
    if (!mig)
        return done(NVML_ERROR_NOT_SUPPORTED);
    p = &mig_profiles[mig->profile];
    memset(a, 0, sizeof *a);
    a->multiprocessorCount = p->sms;
    a->sharedCopyEngineCount = p->copy;
    a->sharedDecoderCount = p->dec;
    a->sharedEncoderCount = 0;
    a->sharedJpegCount = p->jpeg;
    a->sharedOfaCount = p->ofa;
    a->gpuInstanceSliceCount = a->computeInstanceSliceCount = p->slices;
    a->memorySizeMB = p->memory_mb;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes_)
{
    COUNT(nvmlDeviceGetAttributes_v2);
    return attributes(device, attributes_);
}

nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes_)
{
    COUNT(nvmlDeviceGetAttributes);
    return attributes(device, attributes_);
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2, int *level)
{
    int s2;
    COUNT(nvmlDeviceGetTopologyCommonAncestor);
    DEV_BEGIN(device1);
    REQUIRE(level);
    s2 = slot_of(device2);
    REQUIRE(s2 >= 0 && s2 < g_nslots && g_devs[s2].ever_visible);
    if (g_devs[s2].lost || g_devs[s2].removed || !g_devs[s2].visible)
        return done(NVML_ERROR_GPU_IS_LOST);
    if ((d->unsupported | g_devs[s2].unsupported) & U_TOPOLOGY)
        return done(NVML_ERROR_NOT_SUPPORTED);
    *level = d == &g_devs[s2] ? NVML_TOPOLOGY_INTERNAL : g_pcie[d - g_devs][s2];
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, int p2pIndex, int *status)
{
    int s1, s2;
    COUNT(nvmlDeviceGetP2PStatus);
    DEV_BEGIN(device1);
    REQUIRE(status && p2pIndex >= 0 && p2pIndex <= 4);
    s2 = slot_of(device2);
    REQUIRE(s2 >= 0 && s2 < g_nslots && g_devs[s2].ever_visible);
    if (g_devs[s2].lost || g_devs[s2].removed || !g_devs[s2].visible)
        return done(NVML_ERROR_GPU_IS_LOST);
    if ((d->unsupported | g_devs[s2].unsupported) & U_TOPOLOGY)
        return done(NVML_ERROR_NOT_SUPPORTED);
    s1 = (int)(d - g_devs);
    if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK)
        *status = g_nvlink[s1][s2] ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    else   /* PCIe peer-to-peer does not cross the CPU interconnect */
        *status = g_nvlink[s1][s2] || g_pcie[s1][s2] < NVML_TOPOLOGY_SYSTEM
                      ? NVML_P2P_STATUS_OK
                      : NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED;
    return done(NVML_SUCCESS);
}

/*
 * NVLink wiring derived from the link lines (over the currently enumerated
 * peers).  If a GPU's links to its peers add up to at most NVLINK_MAX they are
 * direct: its link indices go to the peers in index order.  Otherwise the
 * peers must be reached through a switch fabric (NVSwitch): the GPU has as
 * many links as its largest peer count and each reports an NVSwitch as the
 * remote end.  Returns the active link count; *peer_slot gets the remote GPU
 * slot for `link` or -1 for a switch (or when the link is inactive).
 */
static int nvlink_route(int slot, unsigned link, int *peer_slot)
{
    int i, total = 0, maxn = 0, acc = 0;
    *peer_slot = -1;
    for (i = 0; i < g_count; i++) {
        int p = g_order[i];
        if (p == slot)
            continue;
        total += g_nvlink[slot][p];
        if (g_nvlink[slot][p] > maxn)
            maxn = g_nvlink[slot][p];
    }
    if (total > NVLINK_MAX)
        return maxn;
    for (i = 0; i < g_count; i++) {
        int p = g_order[i];
        if (p == slot)
            continue;
        acc += g_nvlink[slot][p];
        if (link < (unsigned)acc) {
            *peer_slot = p;
            break;
        }
    }
    return total;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive)
{
    int peer;
    COUNT(nvmlDeviceGetNvLinkState);
    DEV_BEGIN(device);
    REQUIRE(isActive);
    SUPPORTED(U_NVLINK);
    REQUIRE(link < NVLINK_MAX);
    *isActive = link < (unsigned)nvlink_route((int)(d - g_devs), link, &peer) ? NVML_FEATURE_ENABLED
                                                                             : NVML_FEATURE_DISABLED;
    return done(NVML_SUCCESS);
}

/* Shared checks for the per-link queries; inactive links report NOT_SUPPORTED. */
static nvmlReturn_t link_remote(struct fake_dev *d, unsigned link, int *peer)
{
    if (d->unsupported & U_NVLINK)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= NVLINK_MAX)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= (unsigned)nvlink_route((int)(d - g_devs), link, peer))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version)
{
    int peer;
    nvmlReturn_t rc;
    COUNT(nvmlDeviceGetNvLinkVersion);
    DEV_BEGIN(device);
    REQUIRE(version);
    if ((rc = link_remote(d, link, &peer)))
        return done(rc);
    /* NVML_NVLINK_VERSION_*: 3.0 (Ampere) = 4, 4.0 (Hopper) = 6, 5.0 (Blackwell) = 7 */
    *version = d->cc_major >= 10 ? 7 : d->cc_major == 9 ? 6 : d->cc_major == 8 ? 4 : 3;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link, int *type)
{
    int peer;
    nvmlReturn_t rc;
    COUNT(nvmlDeviceGetNvLinkRemoteDeviceType);
    DEV_BEGIN(device);
    REQUIRE(type);
    if ((rc = link_remote(d, link, &peer)))
        return done(rc);
    *type = peer >= 0 ? NVML_NVLINK_DEVICE_TYPE_GPU : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    return done(NVML_SUCCESS);
}

static nvmlReturn_t remote_pci(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    int peer;
    nvmlReturn_t rc;
    DEV_BEGIN(device);
    REQUIRE(pci);
    if ((rc = link_remote(d, link, &peer)))
        return done(rc);
    if (peer >= 0) {
        fill_pci(&g_devs[peer], pci);
    } else {
        /* Four made-up NVSwitch chips, links spread over them as on a DGX H100 (5/4/4/5). */
        struct fake_dev sw;
        memset(&sw, 0, sizeof sw);
        sw.bus = 0x05 + link * 4 / NVLINK_MAX;
        sw.pci_device_id = 0x22A310DE;
        sw.pci_subsystem_id = 0x179610DE;
        fill_pci(&sw, pci);
    }
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    COUNT(nvmlDeviceGetNvLinkRemotePciInfo_v2);
    return remote_pci(device, link, pci);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfoLegacy_t *pci)
{
    nvmlPciInfo_t full;
    nvmlReturn_t rc;
    COUNT(nvmlDeviceGetNvLinkRemotePciInfo);
    if (!pci)
        return remote_pci(device, link, NULL);
    rc = remote_pci(device, link, &full);
    if (rc == NVML_SUCCESS)
        fill_pci_legacy(&full, pci);
    return rc;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending)
{
    COUNT(nvmlDeviceGetRetiredPagesPendingStatus);
    DEV_BEGIN(device);
    REQUIRE(isPending);
    SUPPORTED(U_RETIRED_PAGES);
    *isPending = d->pending_pages ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return done(NVML_SUCCESS);
}

/*
 * The pages retired for one cause (nvmlPageRetirementCause_t: 0 multiple single-bit ECC errors,
 * 1 a double-bit ECC error), in retirement order.  nvml.h: *pageCount in is the room in addresses
 * (and timestamps), out the pages returned, or on INSUFFICIENT_SIZE the count there is; the buffers
 * may be NULL only with *pageCount 0, the size query (SUCCESS when none is retired).  Only GPUs
 * before Ampere retire pages (later ones remap rows, nvmlDeviceGetRemappedRows): NOT_SUPPORTED on
 * cc 8.0 and later, as with unsupported=retired_pages.  timestamps: the _v2 call's, else NULL.
 */
static nvmlReturn_t retired_pages(nvmlDevice_t device, int cause, unsigned int *pageCount,
                                  unsigned long long *addresses, unsigned long long *timestamps, int v2)
{
    unsigned n, k;
    DEV_BEGIN(device);
    REQUIRE(pageCount && (cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS ||
                          cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR));
    if (!retire_supported(d))
        return done(NVML_ERROR_NOT_SUPPORTED);
    n = d->nretired[cause];
    if (*pageCount < n) {
        *pageCount = n;
        return done(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    REQUIRE(*pageCount == 0 || (addresses && (!v2 || timestamps)));
    for (k = 0; k < n; k++) {
        addresses[k] = d->retired_addr[cause][k];
        if (v2)
            timestamps[k] = d->retired_us[cause][k];
    }
    *pageCount = n;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *pageCount,
                                       unsigned long long *addresses)
{
    COUNT(nvmlDeviceGetRetiredPages);
    return retired_pages(device, cause, pageCount, addresses, NULL, 0);
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause, unsigned int *pageCount,
                                          unsigned long long *addresses, unsigned long long *timestamps)
{
    COUNT(nvmlDeviceGetRetiredPages_v2);
    return retired_pages(device, cause, pageCount, addresses, timestamps, 1);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    COUNT(nvmlDeviceGetRemappedRows);
    DEV_BEGIN(device);
    REQUIRE(corrRows && uncRows && isPending && failureOccurred);
    SUPPORTED(U_REMAPPED_ROWS);
    *corrRows = d->corr_rows;
    *uncRows = d->unc_rows;
    *isPending = d->remap_pending;
    *failureOccurred = d->remap_failure;
    return done(NVML_SUCCESS);
}

/* errorType: NVML_MEMORY_ERROR_TYPE_CORRECTED 0, _UNCORRECTED 1; counterType: NVML_VOLATILE_ECC 0, NVML_AGGREGATE_ECC 1. */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                         unsigned long long *eccCounts)
{
    COUNT(nvmlDeviceGetTotalEccErrors);
    DEV_BEGIN(device);
    REQUIRE(eccCounts && (errorType == 0 || errorType == 1) && (counterType == 0 || counterType == 1));
    SUPPORTED(U_ECC);
    *eccCounts = d->ecc[errorType][counterType];
    return done(NVML_SUCCESS);
}

/* A field the GPU gives, of that type: where its value goes. */
static nvmlValue_t *field_given(nvmlFieldValue_t *v, int type)
{
    v->valueType = type;
    v->nvmlReturn = NVML_SUCCESS;
    memset(&v->value, 0, sizeof v->value);
    return &v->value;
}

static void field_uint(nvmlFieldValue_t *v, unsigned value)
{
    field_given(v, NVML_VALUE_TYPE_UNSIGNED_INT)->uiVal = value;
}

static void field_ull(nvmlFieldValue_t *v, unsigned long long value)
{
    field_given(v, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG)->ullVal = value;
}

/*
 * An NVLink throughput field: the KiB each way over all links (scopeId NVLINK_ALL_LINKS), or over one: the
 * active links share the traffic evenly (their counts add up to the whole), an inactive one has none; a
 * link past the most a GPU has is INVALID_ARGUMENT.  The protocol's overhead adds 1/16 to the data.
 */
static void nvlink_field(struct fake_dev *d, nvmlFieldValue_t *v)
{
    unsigned kind = v->fieldId - NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX;   /* data tx, rx, raw tx, rx */
    unsigned long long total, links;
    int peer;
    total = (unsigned long long)(d->nvlink_kib[kind % 2] * (kind >= 2 ? 17.0 / 16.0 : 1.0));
    if (v->scopeId != NVLINK_ALL_LINKS) {
        if (v->scopeId >= NVLINK_MAX) {
            v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
            return;
        }
        links = (unsigned long long)nvlink_route((int)(d - g_devs), 0, &peer);
        total = v->scopeId < links ? total * (v->scopeId + 1) / links - total * v->scopeId / links : 0;
    }
    field_ull(v, total);
}

/*
 * One field's answer, from the same figures and under the same conditions as the call of its own where it
 * has one (a GPU without ECC, page retirement or row remapping refuses those fields as it refuses those
 * calls); a field not given here is NOT_SUPPORTED.  What grows (violation times, NVLink counts) is as of
 * the call's one instant: the caller brought it up to then.
 */
static void field_value(struct fake_dev *d, nvmlFieldValue_t *v)
{
    unsigned id = v->fieldId;
    int figures = !(d->unsupported & U_TELEMETRY);
    if (id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && !(d->unsupported & U_RECOVERY_ACTION))
        field_uint(v, d->recovery_action);
    else if (id == NVML_FI_DEV_MEMORY_TEMP && figures && !(d->unsupported & U_MEMORY_TEMP))
        field_uint(v, d->mem_temp_c);
    else if (id >= NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX && id <= NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX &&
             !(d->unsupported & U_NVLINK))
        nvlink_field(d, v);
    else if (id >= NVML_FI_DEV_PERF_POLICY_POWER && id <= NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS && figures)
        field_ull(v, d->viol_ns[id - NVML_FI_DEV_PERF_POLICY_POWER]);
    else if (id >= NVML_FI_DEV_ECC_SBE_VOL_TOTAL && id <= NVML_FI_DEV_ECC_DBE_AGG_TOTAL && !(d->unsupported & U_ECC))
        /* 3 sbe volatile, 4 dbe volatile, 5 sbe aggregate, 6 dbe aggregate: ecc[errorType][counterType] */
        field_ull(v, d->ecc[(id - NVML_FI_DEV_ECC_SBE_VOL_TOTAL) % 2][(id - NVML_FI_DEV_ECC_SBE_VOL_TOTAL) / 2]);
    else if ((id == NVML_FI_DEV_RETIRED_SBE || id == NVML_FI_DEV_RETIRED_DBE) && retire_supported(d))
        field_ull(v, d->nretired[id - NVML_FI_DEV_RETIRED_SBE]);
    else if (id == NVML_FI_DEV_RETIRED_PENDING && !(d->unsupported & U_RETIRED_PAGES))
        field_uint(v, d->pending_pages ? 1 : 0);
    else if (id == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION && figures)
        field_ull(v, energy_now(d));
    else if (id == NVML_FI_DEV_PCIE_REPLAY_COUNTER && figures)
        field_uint(v, d->pcie_replays);
    else if (id >= NVML_FI_DEV_REMAPPED_COR && id <= NVML_FI_DEV_REMAPPED_FAILURE && !(d->unsupported & U_REMAPPED_ROWS)) {
        unsigned rows[] = {d->corr_rows, d->unc_rows, d->remap_pending, d->remap_failure};
        field_uint(v, rows[id - NVML_FI_DEV_REMAPPED_COR]);
    } else
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    struct timespec ts;
    long long now;
    int i;
    COUNT(nvmlDeviceGetFieldValues);
    DEV_BEGIN(device);
    REQUIRE(valuesCount >= 0 && (values || valuesCount == 0));
    clock_gettime(CLOCK_REALTIME, &ts);
    now = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
    /* One instant for every field, as the one timestamp says: the total held below the applications
       clocks is never less than a policy's part of it. */
    levels_advance(d);
    for (i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = now;
        v->latencyUsec = 0;
        field_value(d, v);
    }
    return done(NVML_SUCCESS);
}

/* ---- exported: running processes ----------------------------------------------- */

/*
 * nvml.h: *infoCount in: room in infos, out: the processes returned, or on
 * INSUFFICIENT_SIZE the room needed.  infos may be NULL only with
 * *infoCount 0, the size query (SUCCESS when nothing runs).  A GPU handle
 * gets all its processes (what NVML gives a privileged caller in MIG mode),
 * a MIG device handle those on that GPU/compute instance.
 */
static int proc_listed(const struct fake_proc *p, unsigned kind, const struct fake_mig *mig)
{
    return (p->kinds & kind) && (!mig || (p->gi == mig->gi && p->ci == mig->ci));
}

static nvmlReturn_t running_procs(nvmlDevice_t device, unsigned int *infoCount, void *infos, unsigned kind,
                                  int legacy)
{
    unsigned need = 0, k = 0;
    int i;
    ANY_BEGIN(device);
    REQUIRE(infoCount);
    SUPPORTED(U_PROCESSES);
    REQUIRE(infos || *infoCount == 0);
    for (i = 0; i < d->nprocs; i++)
        need += (unsigned)proc_listed(&d->procs[i], kind, mig);
    if (*infoCount < need) {
        *infoCount = need;
        return done(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i = 0; i < d->nprocs; i++) {
        const struct fake_proc *p = &d->procs[i];
        if (!proc_listed(p, kind, mig))
            continue;
        if (legacy) {
            nvmlProcessInfo_v1_t *o = (nvmlProcessInfo_v1_t *)infos + k++;
            memset(o, 0, sizeof *o);
            o->pid = p->pid;
            o->usedGpuMemory = p->mem;
        } else {
            nvmlProcessInfo_t *o = (nvmlProcessInfo_t *)infos + k++;
            memset(o, 0, sizeof *o);
            o->pid = p->pid;
            o->usedGpuMemory = p->mem;
            o->gpuInstanceId = p->gi;
            o->computeInstanceId = p->ci;
        }
    }
    *infoCount = need;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    COUNT(nvmlDeviceGetComputeRunningProcesses_v3);
    return running_procs(device, infoCount, infos, K_COMPUTE, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    COUNT(nvmlDeviceGetComputeRunningProcesses_v2);
    return running_procs(device, infoCount, infos, K_COMPUTE, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos)
{
    COUNT(nvmlDeviceGetComputeRunningProcesses);
    return running_procs(device, infoCount, infos, K_COMPUTE, 1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos)
{
    COUNT(nvmlDeviceGetGraphicsRunningProcesses_v3);
    return running_procs(device, infoCount, infos, K_GRAPHICS, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos)
{
    COUNT(nvmlDeviceGetGraphicsRunningProcesses_v2);
    return running_procs(device, infoCount, infos, K_GRAPHICS, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                   nvmlProcessInfo_v1_t *infos)
{
    COUNT(nvmlDeviceGetGraphicsRunningProcesses);
    return running_procs(device, infoCount, infos, K_GRAPHICS, 1);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos)
{
    COUNT(nvmlDeviceGetMPSComputeRunningProcesses_v3);
    return running_procs(device, infoCount, infos, K_MPS, 0);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos)
{
    COUNT(nvmlDeviceGetMPSComputeRunningProcesses_v2);
    return running_procs(device, infoCount, infos, K_MPS, 0);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v1_t *infos)
{
    COUNT(nvmlDeviceGetMPSComputeRunningProcesses);
    return running_procs(device, infoCount, infos, K_MPS, 1);
}

/* ---- exported: telemetry -------------------------------------------------------- */

/* A GPU's figures: a MIG device handle has none of these, as on real MIG devices. */
#define FIGURES_BEGIN(h, out)                          \
    ANY_BEGIN(h);                                      \
    REQUIRE(out);                                      \
    SUPPORTED(U_TELEMETRY);                            \
    if (mig)                                           \
        return done(NVML_ERROR_NOT_SUPPORTED)

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    COUNT(nvmlDeviceGetUtilizationRates);
    FIGURES_BEGIN(device, utilization);
    if (d->mig_mode)   /* "not supported" with MIG on: the GPU's figure would mix instances */
        return done(NVML_ERROR_NOT_SUPPORTED);
    utilization->gpu = d->util_gpu;
    utilization->memory = d->util_mem;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    COUNT(nvmlDeviceGetTemperature);
    FIGURES_BEGIN(device, temp);
    REQUIRE(sensorType == 0);   /* NVML_TEMPERATURE_GPU, the only sensor there is */
    *temp = d->temp_c;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    COUNT(nvmlDeviceGetPowerUsage);
    FIGURES_BEGIN(device, power);
    *power = d->power_mw;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy)
{
    COUNT(nvmlDeviceGetTotalEnergyConsumption);
    FIGURES_BEGIN(device, energy);
    *energy = energy_now(d);
    return done(NVML_SUCCESS);
}

/* type: NVML_CLOCK_GRAPHICS 0, NVML_CLOCK_SM 1, NVML_CLOCK_MEM 2, NVML_CLOCK_VIDEO 3. */
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    COUNT(nvmlDeviceGetClockInfo);
    FIGURES_BEGIN(device, clock);
    REQUIRE(type >= 0 && type <= 3);
    *clock = type == 2 ? d->mem_mhz : type == 3 ? d->sm_mhz * 9 / 10 : d->sm_mhz;
    return done(NVML_SUCCESS);
}

static nvmlReturn_t clock_reasons(nvmlDevice_t device, unsigned long long *reasons)
{
    FIGURES_BEGIN(device, reasons);
    *reasons = d->throttle;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    COUNT(nvmlDeviceGetCurrentClocksEventReasons);
    return clock_reasons(device, reasons);
}

/* The name before R535, kept by NVML. */
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    COUNT(nvmlDeviceGetCurrentClocksThrottleReasons);
    return clock_reasons(device, reasons);
}

/*
 * nvml.h: referenceTime the time of the reading (realtime us), violationTime the ns the policy has held the
 * clocks down since the driver loaded.  Policies 0-5, and 10 (below the applications clocks for any of
 * them); 11 (below the base clocks): NOT_SUPPORTED here; another number: INVALID_ARGUMENT.
 */
nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t device, unsigned int perfPolicyType, nvmlViolationTime_t *violTime)
{
    struct timespec ts;
    COUNT(nvmlDeviceGetViolationStatus);
    FIGURES_BEGIN(device, violTime);
    REQUIRE(perfPolicyType < 6 || perfPolicyType == 10 || perfPolicyType == 11);
    if (perfPolicyType == 11)
        return done(NVML_ERROR_NOT_SUPPORTED);
    levels_advance(d);
    clock_gettime(CLOCK_REALTIME, &ts);
    violTime->referenceTime = (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
    violTime->violationTime = d->viol_ns[perfPolicyType == 10 ? 6 : perfPolicyType];
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value)
{
    COUNT(nvmlDeviceGetPcieReplayCounter);
    FIGURES_BEGIN(device, value);
    *value = d->pcie_replays;
    return done(NVML_SUCCESS);
}

/* The video engines' utilization (percent) over the driver's sampling period, which it gives in us. */
static nvmlReturn_t video_utilization(nvmlDevice_t device, unsigned int *utilization, unsigned int *period_us,
                                      int decoder)
{
    FIGURES_BEGIN(device, utilization);
    REQUIRE(period_us);
    *utilization = decoder ? d->util_dec : d->util_enc;
    *period_us = 167000;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs)
{
    COUNT(nvmlDeviceGetEncoderUtilization);
    return video_utilization(device, utilization, samplingPeriodUs, 0);
}

nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                             unsigned int *samplingPeriodUs)
{
    COUNT(nvmlDeviceGetDecoderUtilization);
    return video_utilization(device, utilization, samplingPeriodUs, 1);
}

/*
 * The samples newer than lastSeenTimeStamp, oldest first.  NOT_FOUND when there is none; a NULL buffer
 * or too small a count: INSUFFICIENT_SIZE with the count needed.  Not on MIG (nvml.h: "querying process
 * utilization is not currently supported" with MIG enabled).
 */
/*
 * What the driver gives for the samples newer than `since`: one entry per process, the mean of its samples
 * (each utilization), stamped with its newest.  Returns how many processes; out holds them, first seen first.
 */
static unsigned process_utilization(int slot, unsigned long long since, nvmlProcessUtilizationSample_t *out)
{
    static unsigned long long sums[SAMPLES_MAX][4];   /* under the library's lock, as out is */
    static unsigned counts[SAMPLES_MAX];
    const struct fake_dev *d = &g_devs[slot];
    unsigned n = 0, k;
    int i;
    for (i = 0; i < d->nsamples; i++) {
        const nvmlProcessUtilizationSample_t *smp = &g_samples[slot][(d->sample_head + i) % SAMPLES_MAX];
        if (smp->timeStamp <= since)
            continue;
        for (k = 0; k < n && out[k].pid != smp->pid; k++)
            ;
        if (k == n) {
            memset(sums[n], 0, sizeof sums[n]);
            counts[n++] = 0;
        }
        out[k] = *smp;   /* samples are oldest first: the newest stamp stays */
        sums[k][0] += smp->smUtil, sums[k][1] += smp->memUtil, sums[k][2] += smp->encUtil, sums[k][3] += smp->decUtil;
        counts[k]++;
    }
    for (k = 0; k < n; k++) {
        out[k].smUtil = (unsigned)(sums[k][0] / counts[k]), out[k].memUtil = (unsigned)(sums[k][1] / counts[k]);
        out[k].encUtil = (unsigned)(sums[k][2] / counts[k]), out[k].decUtil = (unsigned)(sums[k][3] / counts[k]);
    }
    return n;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp)
{
    static nvmlProcessUtilizationSample_t found[SAMPLES_MAX];   /* under the library's lock */
    unsigned need;
    COUNT(nvmlDeviceGetProcessUtilization);
    FIGURES_BEGIN(device, processSamplesCount);
    if (d->mig_mode)
        return done(NVML_ERROR_NOT_SUPPORTED);
    need = process_utilization((int)(d - g_devs), lastSeenTimeStamp, found);
    if (!need)
        return done(NVML_ERROR_NOT_FOUND);
    if (!utilization || *processSamplesCount < need) {
        *processSamplesCount = need;
        return done(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    memcpy(utilization, found, need * sizeof found[0]);
    *processSamplesCount = need;
    return done(NVML_SUCCESS);
}

/* ---- exported: GPM -------------------------------------------------------------- */

/*
 * GPU Performance Monitoring (Hopper and later): the caller takes two samples
 * and nvmlGpmMetricsGet gives each metric's mean over the time between them.
 * Each GPU holds an activity level per metric ("gpm") and its integral over
 * time; a sample copies the integrals up to the moment it is taken, so a
 * metric is (integral2 - integral1) / (t2 - t1): a level changed within the
 * window gives the time-weighted mean, as the hardware counters do.  See
 * "GPM" in the header comment for the return codes.
 */

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport)
{
    COUNT(nvmlGpmQueryDeviceSupport);
    DEV_BEGIN(device);
    REQUIRE(gpmSupport);
    if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION)
        return done(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    gpmSupport->isSupportedDevice = (unsigned)gpm_supported(d);
    return done(NVML_SUCCESS);
}

/* The allocated sample s is, or NULL: looked up first, so a foreign pointer is never read. */
static struct fake_gpm_sample *gpm_sample(nvmlGpmSample_t s)
{
    struct fake_gpm_sample *p;
    for (p = g_gpm_samples; p; p = p->next)
        if (p == s)
            return p->magic == GPM_MAGIC ? p : NULL;
    return NULL;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample)
{
    struct fake_gpm_sample *s;
    COUNT(nvmlGpmSampleAlloc);
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    REQUIRE(gpmSample);
    s = calloc(1, sizeof *s);
    if (!s)
        return done(20);   /* NVML_ERROR_MEMORY */
    s->magic = GPM_MAGIC;
    s->slot = -1;
    s->next = g_gpm_samples;
    g_gpm_samples = s;
    *gpmSample = s;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample)
{
    struct fake_gpm_sample **pp;
    COUNT(nvmlGpmSampleFree);
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    for (pp = &g_gpm_samples; *pp && *pp != gpmSample; pp = &(*pp)->next)
        ;
    REQUIRE(*pp && gpmSample->magic == GPM_MAGIC);
    *pp = gpmSample->next;
    gpmSample->magic = 0;
    free(gpmSample);
    return done(NVML_SUCCESS);
}

/* Fills s from the GPU now: its integrals, the time, and which GPU (and GPU instance) it was. */
static void gpm_take(struct fake_dev *d, struct fake_gpm_sample *s, unsigned gi)
{
    s->t_ns = levels_advance(d);
    memcpy(s->integral, d->gpm_integral, sizeof s->integral);
    s->slot = (int)(d - g_devs);
    memcpy(s->uuid, d->uuid, sizeof s->uuid);
    s->gi = gi;
    s->taken = 1;
}

/* The whole GPU's sample; a GPU in MIG mode has only its GPU instances' (nvmlGpmMigSampleGet). */
nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
    struct fake_gpm_sample *s;
    COUNT(nvmlGpmSampleGet);
    DEV_BEGIN(device);
    s = gpm_sample(gpmSample);
    REQUIRE(s);
    if (!gpm_supported(d) || d->mig_mode)
        return done(NVML_ERROR_NOT_SUPPORTED);
    gpm_take(d, s, ID_ANY);
    return done(NVML_SUCCESS);
}

/*
 * One GPU instance's sample, on the GPU's handle (not a MIG device's): NOT_SUPPORTED outside MIG
 * mode, NOT_FOUND for an id no GPU instance has.  Its levels are the GPU's own.
 */
nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t gpmSample)
{
    struct fake_gpm_sample *s;
    int k;
    COUNT(nvmlGpmMigSampleGet);
    DEV_BEGIN(device);
    s = gpm_sample(gpmSample);
    REQUIRE(s);
    if (!gpm_supported(d) || !d->mig_mode)
        return done(NVML_ERROR_NOT_SUPPORTED);
    for (k = 0; k < d->nmig && g_migs[d->mig[k]].gi != gpuInstanceId; k++)
        ;
    if (k == d->nmig)
        return done(NVML_ERROR_NOT_FOUND);
    gpm_take(d, s, gpuInstanceId);
    return done(NVML_SUCCESS);
}

/*
 * Each of the first numMetrics entries gets its metric's mean level between the two samples, or
 * its own nvmlReturn NOT_SUPPORTED for an id this fake does not model (the call still succeeds).
 * Only those entries are touched, so any NVML_GPM_METRIC_MAX of a caller's header works.
 */
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    const struct fake_gpm_sample *s1, *s2;
    double secs;
    unsigned i;
    int k;
    COUNT(nvmlGpmMetricsGet);
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    REQUIRE(metricsGet);
    if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION)
        return done(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(metricsGet->numMetrics <= NVML_GPM_METRIC_MAX);
    s1 = gpm_sample(metricsGet->sample1);
    s2 = gpm_sample(metricsGet->sample2);
    REQUIRE(s1 && s2 && s1->taken && s2->taken);
    REQUIRE(s1->slot == s2->slot && !strcmp(s1->uuid, s2->uuid) && s1->gi == s2->gi);
    REQUIRE(s2->t_ns > s1->t_ns);
    secs = (double)(s2->t_ns - s1->t_ns) / 1e9;
    for (i = 0; i < metricsGet->numMetrics; i++) {
        nvmlGpmMetric_t *m = &metricsGet->metrics[i];
        const struct gpm_metric *g;
        double v;
        for (k = 0; k < GPM_N && gpm_metrics[k].id != m->metricId; k++)
            ;
        memset(&m->metricInfo, 0, sizeof m->metricInfo);
        m->value = 0;
        if (k == GPM_N) {
            m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        g = &gpm_metrics[k];
        v = (s2->integral[k] - s1->integral[k]) / secs;
        m->value = v < 0 ? 0 : v > g->max ? g->max : v;   /* rounding must not leave the range */
        m->nvmlReturn = NVML_SUCCESS;
        m->metricInfo.shortName = (char *)g->short_name;
        m->metricInfo.longName = (char *)g->long_name;
        m->metricInfo.unit = (char *)g->unit;
    }
    return done(NVML_SUCCESS);
}

/* ---- exported: events ----------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    COUNT(nvmlDeviceGetSupportedEventTypes);
    DEV_BEGIN(device);
    REQUIRE(eventTypes);
    SUPPORTED(U_EVENTS);
    *eventTypes = d->events;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    struct fake_evset *s;
    COUNT(nvmlEventSetCreate);
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    REQUIRE(set);
    s = calloc(1, sizeof *s);
    if (!s)
        return done(20);   /* NVML_ERROR_MEMORY */
    set_cond_init(s);
    s->next = g_sets;
    g_sets = s;
    *set = s;
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    COUNT(nvmlDeviceRegisterEvents);
    DEV_BEGIN(device);
    REQUIRE(set_valid(set));
    SUPPORTED(U_EVENTS);
    if (eventTypes & ~d->events)
        return done(NVML_ERROR_NOT_SUPPORTED);
    set->reg[d - g_devs] |= eventTypes;
    return done(NVML_SUCCESS);
}

static void set_release(struct fake_evset *s)
{
    pthread_cond_destroy(&s->cond);
    free(s);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    struct fake_evset **pp;
    COUNT(nvmlEventSetFree);
    nvmlReturn_t rc = sys_begin();
    if (rc)
        return rc;
    REQUIRE(set_valid(set));
    if (set->waiters) {   /* as the driver does, wait for the waits in progress to return */
        g_shutdown_waits++;
        while (set_valid(set) && set->waiters)
            pthread_cond_wait(&g_waits_done, &g_lock);
        if (!g_refcount)
            return done(NVML_ERROR_UNINITIALIZED);
        REQUIRE(set_valid(set));   /* a full shutdown released it meanwhile */
    }
    for (pp = &g_sets; *pp != set; pp = &(*pp)->next)
        ;
    *pp = set->next;
    set_release(set);
    return done(NVML_SUCCESS);
}

static nvmlReturn_t event_wait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms, int v2)
{
    struct timespec deadline;
    nvmlReturn_t rc, injected = NVML_SUCCESS;
    int timed_out = 0;
    rc = sys_begin();
    if (rc)
        return rc;
    while (g_shutting_down)
        pthread_cond_wait(&g_waits_done, &g_lock);
    if (!g_refcount)
        return done(NVML_ERROR_UNINITIALIZED);
    REQUIRE(data && set_valid(set));
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeoutms / 1000;
    deadline.tv_nsec += (long)(timeoutms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    set->waiters++;
    g_waiting++;
    for (;;) {
        if (g_wait_left) {   /* "wait_error": fails even with events queued, leaving them there */
            injected = g_wait_error;
            if (g_wait_left > 0)
                g_wait_left--;
            break;
        }
        if (set->count || !timeoutms || timed_out)
            break;
        timed_out = pthread_cond_timedwait(&set->cond, &g_lock, &deadline) == ETIMEDOUT;
    }
    set->waiters--;
    g_waiting--;
    pthread_cond_broadcast(&g_waits_done);
    if (injected)
        return done(injected);
    if (set->count == 0)
        return done(NVML_ERROR_TIMEOUT);
    {
        struct ev *e = &set->q[set->head];
        set->head = (set->head + 1) % QCAP;
        set->count--;
        data->device = &g_devs[e->slot];
        data->eventType = e->type;
        data->eventData = e->data;
        if (v2) {   /* the pre-v2 struct ends after eventData */
            data->gpuInstanceId = e->gi;
            data->computeInstanceId = e->ci;
        }
    }
    return done(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    COUNT(nvmlEventSetWait_v2);
    return event_wait(set, data, timeoutms, 1);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    COUNT(nvmlEventSetWait);
    return event_wait(set, data, timeoutms, 0);
}
