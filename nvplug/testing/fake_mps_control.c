/*
 * A stand-in for NVIDIA's nvidia-cuda-mps-control, for tests on machines without a GPU.
 *
 * Build: cc -static -O2 -Wall -Wextra -o nvidia-cuda-mps-control fake_mps_control.c
 * (static and libc only: its client mode runs in busybox-only containers as any UID).
 *
 *   nvidia-cuda-mps-control -d                  control daemon in the background
 *   nvidia-cuda-mps-control -f                  control daemon in the foreground (logs to stderr too)
 *   nvidia-cuda-mps-control                     client: commands from stdin, one a line
 *   nvidia-cuda-mps-control --fake-cuda-client  test hook: connect like a CUDA application
 *   nvidia-cuda-mps-control --fake-cuda-client --hold [FILE]
 *                                               ... and stay connected, holding FILE (made) open,
 *                                               as a CUDA process holds its context and its shm
 *   nvidia-cuda-mps-control -h | --help
 *
 * Environment: CUDA_MPS_PIPE_DIRECTORY (/tmp/nvidia-mps), CUDA_MPS_LOG_DIRECTORY
 * (/var/log/nvidia-mps), CUDA_VISIBLE_DEVICES (the daemon's devices; unset: one, "0"),
 * FAKE_MPS_COMMAND_LOG (default <log dir>/commands.jsonl), FAKE_MPS_CRASH_AFTER=<n>.
 *
 * Protocol (this stand-in's own): the daemon listens on the unix stream socket
 * <pipe>/control, mode 0666. A connection's first line says what it is: "ui" (the
 * client mode), "cuda" (a fake CUDA application) or "server" (an MPS server started by
 * the daemon, as its client UID). A connection that closes without a valid first line
 * is logged as "User did not send valid credentials", as the real daemon logs the first
 * probe of every CUDA client. Each UI command gets an answer: lines "| text" (output),
 * "! text" (error text), then "= 0" (success) or "= 1" (error).
 *
 * Like the real daemon, it runs one MPS server at a time: a client of another UID waits
 * until the current server (which has no lasting clients here) has exited. A server is
 * a forked child that switches to the client's UID and GID, then connects to
 * <pipe>/control as that user: it needs search permission on every parent of the pipe
 * directory, the failure behind NVIDIA k8s-device-plugin issue #762.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_PIPE_DIR "/tmp/nvidia-mps"
#define DEFAULT_LOG_DIR "/var/log/nvidia-mps"
#define PID_FILE_NAME "nvidia-cuda-mps-control.pid"
#define MAX_CONNS 256
#define MAX_SERVERS 8
#define MAX_DEVICES 64
#define MAX_LINE 4096
#define MAX_OUT (1 << 20)
#define LIMIT_LEN 32
#define SERVER_READY_MS 10000LL /* a server that has not registered by then is killed */
#define QUIT_DEFAULT_WAIT_S 10.0
#define EXIT_SETUID_FAILED 3 /* a server child that could not switch to its user */
#define NO_DEVICES_MESSAGE "no CUDA devices"

enum conn_kind { C_NEW, C_UI, C_CUDA, C_SERVER };
enum wait_kind { W_NONE, W_SERVER, W_EXIT };
enum server_state { S_FREE, S_STARTING, S_READY, S_STOPPING };

struct conn {
    int fd;
    enum conn_kind kind;
    pid_t pid;
    uid_t uid;
    gid_t gid;
    char in[MAX_LINE];
    size_t inlen;
    char *out;
    size_t outlen, outcap;
    enum wait_kind waiting;
    uid_t wait_uid; /* W_SERVER: a server for this user */
    gid_t wait_gid;
    pid_t wait_pid; /* W_EXIT: this server's exit */
    pid_t served_by; /* C_CUDA: the server it was answered with (0: none yet) */
    unsigned long seq; /* arrival order of waits */
};

struct server {
    enum server_state state;
    pid_t pid;
    uid_t uid;
    gid_t gid;
    double pct;
    char limits[MAX_DEVICES][LIMIT_LEN];
    int conn; /* its registration connection, or -1 */
    long long started_ms;
};

struct device {
    char id[128];
    char limit[LIMIT_LEN]; /* "" while unset */
};

static char g_pipe_dir[PATH_MAX];
static char g_log_dir[PATH_MAX];
static char g_sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static char g_pid_path[PATH_MAX + 64];
static char g_control_log[PATH_MAX + 64];
static char g_server_log[PATH_MAX + 64];
static char g_command_log[PATH_MAX + 64];
static int g_log_fd = -1;
static int g_log_stderr;
static int g_listen_fd = -1;
static int g_sig_pipe[2] = {-1, -1};
static volatile sig_atomic_t g_term;
static double g_default_pct = 100.0;
static struct device g_devices[MAX_DEVICES];
static int g_ndevices;
static long g_commands_seen;
static long g_crash_after = -1;
static unsigned long g_seq;
static struct conn g_conns[MAX_CONNS];
static struct server g_servers[MAX_SERVERS];

static int process_lines(struct conn *c);

/* ---------------------------------------------------------------- helpers */

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One log line as the real tools write it: [YYYY-MM-DD HH:MM:SS.mmm Role   PID] message */
static void vlog_line(int fd, int also_stderr, const char *role, const char *fmt, va_list ap) {
    char buf[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    localtime_r(&ts.tv_sec, &tm);
    int n = snprintf(buf, sizeof buf, "[%04d-%02d-%02d %02d:%02d:%02d.%03ld %s %5d] ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L, role,
                     (int)getpid());
    if (n < 0)
        return;
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    if (m < 0)
        return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2)
        len = sizeof buf - 2;
    buf[len++] = '\n';
    /* One write per line: daemon and server children append to the same file. */
    if (fd >= 0 && write(fd, buf, len) < 0) {
        /* nothing sensible to do */
    }
    if (also_stderr && write(STDERR_FILENO, buf, len) < 0) {
        /* nothing sensible to do */
    }
}

__attribute__((format(printf, 1, 2))) static void ctl_log(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog_line(g_log_fd, g_log_stderr, "Control", fmt, ap);
    va_end(ap);
}

__attribute__((format(printf, 3, 4))) static void slog(int fd, const char *role, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog_line(fd, 0, role, fmt, ap);
    va_end(ap);
}

static int mkdir_p(const char *path, mode_t mode) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(tmp, mode) < 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    if (mkdir(tmp, mode) < 0 && errno != EEXIST)
        return -1;
    return 0;
}

static void absolute_path(char *dst, size_t size, const char *path) {
    char cwd[PATH_MAX];
    int n;
    if (path[0] == '/' || getcwd(cwd, sizeof cwd) == NULL)
        n = snprintf(dst, size, "%s", path);
    else
        n = snprintf(dst, size, "%s/%s", cwd, path);
    if (n < 0 || (size_t)n >= size)
        dst[size - 1] = '\0'; /* too long to use: binding the socket fails with a clear message */
    size_t len = strlen(dst);
    while (len > 1 && dst[len - 1] == '/')
        dst[--len] = '\0';
}

static void set_paths(void) {
    const char *pipe_dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    const char *log_dir = getenv("CUDA_MPS_LOG_DIRECTORY");
    absolute_path(g_pipe_dir, sizeof g_pipe_dir, pipe_dir && *pipe_dir ? pipe_dir : DEFAULT_PIPE_DIR);
    absolute_path(g_log_dir, sizeof g_log_dir, log_dir && *log_dir ? log_dir : DEFAULT_LOG_DIR);
    snprintf(g_pid_path, sizeof g_pid_path, "%s/%s", g_pipe_dir, PID_FILE_NAME);
    snprintf(g_control_log, sizeof g_control_log, "%s/control.log", g_log_dir);
    snprintf(g_server_log, sizeof g_server_log, "%s/server.log", g_log_dir);
    const char *command_log = getenv("FAKE_MPS_COMMAND_LOG");
    if (command_log && *command_log)
        snprintf(g_command_log, sizeof g_command_log, "%s", command_log);
    else
        snprintf(g_command_log, sizeof g_command_log, "%s/commands.jsonl", g_log_dir);
}

/* The control socket's path, or -1 if it does not fit in sun_path. */
static int sock_path(void) {
    int n = snprintf(g_sock_path, sizeof g_sock_path, "%s/control", g_pipe_dir);
    return n < 0 || (size_t)n >= sizeof g_sock_path ? -1 : 0;
}

static int connect_control(void) {
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, g_sock_path, strlen(g_sock_path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0 && errno == ENOTSOCK)
            n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static void set_block(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0)
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n')
        s++;
    size_t len = strlen(s);
    while (len > 0 && (s[len - 1] == ' ' || s[len - 1] == '\t' || s[len - 1] == '\r' || s[len - 1] == '\n'))
        s[--len] = '\0';
    return s;
}

static int parse_long(const char *s, long min, long max, long *out) {
    if (s == NULL || *s == '\0')
        return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end != '\0' || v < min || v > max)
        return -1;
    *out = v;
    return 0;
}

/* The primary GID of a UID from /etc/passwd (no NSS in a static binary), else the UID. */
static gid_t gid_of(uid_t uid) {
    FILE *f = fopen("/etc/passwd", "re");
    gid_t gid = (gid_t)uid;
    if (f == NULL)
        return gid;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char *fields[4] = {0};
        char *p = line;
        int i;
        for (i = 0; i < 4 && p; i++) {
            fields[i] = p;
            p = strchr(p, ':');
            if (p)
                *p++ = '\0';
        }
        long u, g;
        if (i == 4 && parse_long(fields[2], 0, LONG_MAX, &u) == 0 && (uid_t)u == uid &&
            parse_long(trim(fields[3]), 0, LONG_MAX, &g) == 0) {
            gid = (gid_t)g;
            break;
        }
    }
    fclose(f);
    return gid;
}

/* ----------------------------------------------------------- test hooks */

/* Standard input, output and error on /dev/null: a server or a background daemon keeps no pipe of
   whoever started it open. */
static void stdio_to_devnull(void) {
    int devnull = open("/dev/null", O_RDWR);
    if (devnull < 0)
        return;
    dup2(devnull, 0);
    dup2(devnull, 1);
    dup2(devnull, 2);
    if (devnull > 2)
        close(devnull);
}

static void record_command(const struct conn *c, const char *command) {
    char buf[MAX_LINE * 6 + 128];
    /* CLOCK_MONOTONIC is the machine's, so a test can order a command against its own clock. */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int n = snprintf(buf, sizeof buf, "{\"uid\":%u,\"pid\":%d,\"monotonic\":%lld.%09ld,\"command\":\"",
                     (unsigned)c->uid, (int)c->pid, (long long)now.tv_sec, now.tv_nsec);
    size_t len = (size_t)n;
    for (const unsigned char *p = (const unsigned char *)command; *p && len < sizeof buf - 16; p++) {
        if (*p == '"' || *p == '\\') {
            buf[len++] = '\\';
            buf[len++] = (char)*p;
        } else if (*p < 0x20 || *p == 0x7f) {
            len += (size_t)snprintf(buf + len, sizeof buf - len, "\\u%04x", *p);
        } else {
            buf[len++] = (char)*p;
        }
    }
    len += (size_t)snprintf(buf + len, sizeof buf - len, "\"}\n");
    int fd = open(g_command_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (write(fd, buf, len) < 0) {
        /* a test reading the log will notice */
    }
    close(fd);
}

/* As a crashed real daemon: a fatal line, then SIGABRT; socket and pid file stay behind. */
__attribute__((noreturn)) static void crash(const char *why) {
    ctl_log("Control daemon encountered a fatal exception (%s). Aborting", why);
    struct rlimit none = {0, 0};
    setrlimit(RLIMIT_CORE, &none); /* no core files in the test's directory */
    signal(SIGABRT, SIG_DFL);
    abort();
}

/* Stop answering anything: the socket stays open, connections queue up, nothing replies. */
__attribute__((noreturn)) static void hang(void) {
    ctl_log("Control daemon stops answering (fake_hang)");
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    for (;;)
        pause();
}

/* ------------------------------------------------------------ connections */

static void out_append(struct conn *c, const char *text, size_t len) {
    if (c->fd < 0)
        return;
    if (c->outlen + len > MAX_OUT) {
        /* A client that reads nothing must not grow us without end: drop it. */
        c->outlen = 0;
        shutdown(c->fd, SHUT_RDWR);
        return;
    }
    if (c->outlen + len > c->outcap) {
        size_t cap = c->outcap ? c->outcap : 256;
        while (cap < c->outlen + len)
            cap *= 2;
        char *out = realloc(c->out, cap);
        if (out == NULL)
            return;
        c->out = out;
        c->outcap = cap;
    }
    memcpy(c->out + c->outlen, text, len);
    c->outlen += len;
}

__attribute__((format(printf, 3, 4))) static void reply_line(struct conn *c, char tag, const char *fmt, ...) {
    char buf[MAX_LINE + 8];
    buf[0] = tag;
    buf[1] = ' ';
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + 2, sizeof buf - 3, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t len = 2 + ((size_t)n < sizeof buf - 3 ? (size_t)n : sizeof buf - 4);
    buf[len++] = '\n';
    out_append(c, buf, len);
}

static void reply_end(struct conn *c, int ok) {
    out_append(c, ok ? "= 0\n" : "= 1\n", 4);
}

#define reply_error(c, ...)                                                                                          \
    do {                                                                                                             \
        reply_line((c), '!', __VA_ARGS__);                                                                           \
        reply_end((c), 0);                                                                                           \
    } while (0)

static void flush_conn(struct conn *c) {
    while (c->fd >= 0 && c->outlen > 0) {
        ssize_t n = send(c->fd, c->out, c->outlen, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                c->outlen = 0; /* gone: its EOF will close it */
            return;
        }
        memmove(c->out, c->out + n, c->outlen - (size_t)n);
        c->outlen -= (size_t)n;
    }
}

static void close_conn(struct conn *c) {
    if (c->fd < 0)
        return;
    for (int i = 0; i < MAX_SERVERS; i++)
        if (g_servers[i].state != S_FREE && g_servers[i].conn == (int)(c - g_conns))
            g_servers[i].conn = -1;
    close(c->fd);
    c->fd = -1;
    free(c->out);
    c->out = NULL;
    c->outlen = c->outcap = c->inlen = 0;
    c->waiting = W_NONE;
}

/* ---------------------------------------------------------------- devices */

static void parse_devices(void) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    g_ndevices = 0;
    if (env == NULL) {
        snprintf(g_devices[0].id, sizeof g_devices[0].id, "0");
        g_ndevices = 1;
        return;
    }
    char copy[MAX_LINE];
    snprintf(copy, sizeof copy, "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && g_ndevices < MAX_DEVICES; tok = strtok_r(NULL, ",", &save)) {
        tok = trim(tok);
        if (*tok == '\0')
            continue;
        snprintf(g_devices[g_ndevices].id, sizeof g_devices[g_ndevices].id, "%s", tok);
        g_devices[g_ndevices].limit[0] = '\0';
        g_ndevices++;
    }
}

/* A device as commands name it: a position in CUDA_VISIBLE_DEVICES, or an entry's UUID. */
static int find_device(const char *tok) {
    long index;
    if (parse_long(tok, 0, MAX_DEVICES - 1, &index) == 0)
        return index < g_ndevices ? (int)index : -1;
    for (int i = 0; i < g_ndevices; i++)
        if (strcasecmp(g_devices[i].id, tok) == 0)
            return i;
    return -1;
}

/* "4096M" or "2G" (integer plus M or G, as the real tool takes it), normalized to upper case. */
static int parse_limit(const char *tok, char *out, unsigned long long *bytes) {
    size_t len = strlen(tok);
    if (len < 2 || len > 20)
        return -1;
    char unit = tok[len - 1];
    unsigned long long scale;
    if (unit == 'M' || unit == 'm')
        scale = 1ULL << 20;
    else if (unit == 'G' || unit == 'g')
        scale = 1ULL << 30;
    else
        return -1;
    unsigned long long v = 0;
    for (size_t i = 0; i + 1 < len; i++) {
        if (tok[i] < '0' || tok[i] > '9')
            return -1;
        v = v * 10 + (unsigned long long)(tok[i] - '0');
        if (v > (1ULL << 34))
            return -1;
    }
    snprintf(out, LIMIT_LEN, "%llu%c", v, unit == 'm' || unit == 'M' ? 'M' : 'G');
    *bytes = v * scale;
    return 0;
}

static unsigned long long limit_bytes(const char *limit) {
    char norm[LIMIT_LEN];
    unsigned long long bytes = 0;
    if (parse_limit(limit, norm, &bytes) < 0)
        return 0;
    return bytes;
}

/* ---------------------------------------------------------------- servers */

static struct server *find_server(pid_t pid) {
    for (int i = 0; i < MAX_SERVERS; i++)
        if (g_servers[i].state != S_FREE && g_servers[i].pid == pid)
            return &g_servers[i];
    return NULL;
}

static struct server *server_by_token(const char *tok) {
    long pid;
    if (parse_long(tok, 1, INT_MAX, &pid) < 0)
        return NULL;
    return find_server((pid_t)pid);
}

static struct server *live_server(void) {
    for (int i = 0; i < MAX_SERVERS; i++)
        if (g_servers[i].state != S_FREE)
            return &g_servers[i];
    return NULL;
}

static volatile sig_atomic_t g_server_term;

static void server_on_term(int sig) {
    (void)sig;
    g_server_term = 1;
}

/* The child: switch to the client's user, reach the control socket as that user, then idle. */
__attribute__((noreturn)) static void server_main(uid_t uid, gid_t gid, double pct, char limits[][LIMIT_LEN]) {
    g_log_stderr = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = server_on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);

    /* Opened while still privileged: the log directory is usually root's. */
    int server_log = open(g_server_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    /* Keep nothing of the daemon's: a supervisor's stderr pipe must not outlive the daemon. */
    stdio_to_devnull();
    for (int fd = 3; fd < 1024; fd++)
        if (fd != server_log && fd != g_log_fd)
            close(fd);

    ctl_log("Starting new server %d for user %u", (int)getpid(), (unsigned)uid);
    slog(server_log, "Other", "Startup");
    if (uid != geteuid() || gid != getegid()) {
        /* What the real daemon does before it starts a client's server. */
        if (setgroups(0, NULL) < 0 && errno != EPERM) {
            ctl_log("Failed to start server for user %u: setgroups: %s", (unsigned)uid, strerror(errno));
            _exit(EXIT_SETUID_FAILED);
        }
        if (setgid(gid) < 0 || setuid(uid) < 0) {
            ctl_log("Failed to start server for user %u: cannot switch to uid %u gid %u: %s", (unsigned)uid,
                 (unsigned)uid, (unsigned)gid, strerror(errno));
            _exit(EXIT_SETUID_FAILED);
        }
    }
    slog(server_log, "Other", "Connecting to control daemon on socket: %s", g_sock_path);
    int fd = connect_control();
    if (fd < 0) {
        slog(server_log, "Other", "Failed to connect to control daemon on socket %s: %s", g_sock_path,
             strerror(errno));
        _exit(1);
    }
    slog(server_log, "Other", "Initializing server process");
    if (write_all(fd, "server\n", 7) < 0)
        _exit(1);
    char buf[64];
    size_t got = 0;
    while (got < 4) {
        ssize_t n = read(fd, buf + got, sizeof buf - got);
        if (g_server_term) {
            /* Stopped before it saw the daemon's answer: a normal shutdown all the same. */
            slog(server_log, "Server", "Server shutting down");
            _exit(0);
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            _exit(1);
        got += (size_t)n;
    }
    if (memcmp(buf, "= 0\n", 4) != 0) {
        slog(server_log, "Server", "Control daemon refused the server");
        _exit(1);
    }
    slog(server_log, "Server", "Active Threads Percentage set to %.1f", pct);
    for (int i = 0; i < g_ndevices; i++)
        if (limits[i][0])
            slog(server_log, "Server", "Device pinned memory limit for device %d set to 0x%llx bytes", i,
                 limit_bytes(limits[i]));
    slog(server_log, "Server", "Server has started");
    /* Idle until told to stop (SIGTERM) or until the daemon goes away (EOF). */
    while (!g_server_term) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n == 0 || (n < 0 && errno != EINTR))
            break;
    }
    slog(server_log, "Server", "Server shutting down");
    _exit(0);
}

static void start_server(uid_t uid, gid_t gid) {
    struct server *s = NULL;
    for (int i = 0; i < MAX_SERVERS && s == NULL; i++)
        if (g_servers[i].state == S_FREE)
            s = &g_servers[i];
    if (s == NULL)
        return;
    memset(s, 0, sizeof *s);
    s->uid = uid;
    s->gid = gid;
    s->pct = g_default_pct;
    for (int i = 0; i < g_ndevices; i++)
        memcpy(s->limits[i], g_devices[i].limit, LIMIT_LEN);
    s->conn = -1;
    pid_t pid = fork();
    if (pid < 0) {
        ctl_log("Failed to start server for user %u: fork: %s", (unsigned)uid, strerror(errno));
        return;
    }
    if (pid == 0)
        server_main(uid, gid, s->pct, s->limits);
    s->pid = pid;
    s->state = S_STARTING;
    s->started_ms = now_ms();
}

static void answer_cuda(struct conn *c, const struct server *s) {
    c->served_by = s->pid;
    char limits[MAX_LINE] = "";
    size_t len = 0;
    for (int i = 0; i < g_ndevices && len < sizeof limits - 64; i++)
        if (s->limits[i][0])
            len += (size_t)snprintf(limits + len, sizeof limits - len, "%s%d=%s", len ? "," : "", i, s->limits[i]);
    reply_line(c, '|', "connected to MPS server %d (user %u, active thread percentage %.1f, pinned memory limits %s)",
               (int)s->pid, (unsigned)s->uid, s->pct, len ? limits : "none");
    reply_end(c, 1);
}

static void finish_wait(struct conn *c) {
    c->waiting = W_NONE;
    process_lines(c);
}

static void resolve_waiters(const struct server *s) {
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &g_conns[i];
        if (c->fd < 0 || c->waiting != W_SERVER || c->wait_uid != s->uid)
            continue;
        if (c->kind == C_CUDA)
            answer_cuda(c, s);
        else
            reply_end(c, 1);
        finish_wait(c);
    }
}

static void fail_waiters(uid_t uid, const char *message) {
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &g_conns[i];
        if (c->fd < 0 || c->waiting != W_SERVER || c->wait_uid != uid)
            continue;
        reply_error(c, "%s", message);
        finish_wait(c);
    }
}

/* One server at a time, as the real daemon: start the server the oldest waiter needs. */
static void schedule(void) {
    struct conn *first = NULL;
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &g_conns[i];
        if (c->fd >= 0 && c->waiting == W_SERVER && (first == NULL || c->seq < first->seq))
            first = c;
    }
    if (first == NULL)
        return;
    struct server *s = live_server();
    if (s == NULL) {
        start_server(first->wait_uid, first->wait_gid);
        return;
    }
    if (s->state == S_READY && s->uid == first->wait_uid) {
        resolve_waiters(s);
        return;
    }
    if (s->state == S_READY) {
        /* Its clients are done at once here: fake clients do not stay connected. */
        ctl_log("Server %d for user %u is shutting down to serve user %u", (int)s->pid, (unsigned)s->uid,
             (unsigned)first->wait_uid);
        s->state = S_STOPPING;
        kill(s->pid, SIGTERM);
    }
}

static void wait_for_server(struct conn *c, uid_t uid, gid_t gid) {
    c->waiting = W_SERVER;
    c->wait_uid = uid;
    c->wait_gid = gid;
    c->seq = ++g_seq;
}

static void server_exited(struct server *s, int status) {
    enum server_state was = s->state;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (was == S_STARTING)
        ctl_log("Server encountered a fatal exception. Shutting down");
    if (WIFEXITED(status))
        ctl_log("Server %d exited with status %d", (int)s->pid, code);
    else
        ctl_log("Server %d was terminated by signal %d", (int)s->pid, WTERMSIG(status));
    uid_t uid = s->uid;
    pid_t pid = s->pid;
    if (s->conn >= 0)
        close_conn(&g_conns[s->conn]);
    s->state = S_FREE;
    s->pid = 0;
    if (was == S_STARTING) {
        char message[512];
        if (code == EXIT_SETUID_FAILED)
            snprintf(message, sizeof message,
                     "The MPS server for user %u could not be started: the control daemon cannot switch to that "
                     "user",
                     (unsigned)uid);
        else
            snprintf(message, sizeof message,
                     "The MPS server for user %u failed to start: server %d exited with status %d (see server.log)",
                     (unsigned)uid, (int)pid, code);
        fail_waiters(uid, message);
    }
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &g_conns[i];
        if (c->fd >= 0 && c->waiting == W_EXIT && c->wait_pid == pid) {
            reply_end(c, 1);
            finish_wait(c);
        }
    }
}

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            return;
        struct server *s = find_server(pid);
        if (s != NULL)
            server_exited(s, status);
    }
}

static void check_startup_deadlines(void) {
    long long now = now_ms();
    for (int i = 0; i < MAX_SERVERS; i++) {
        struct server *s = &g_servers[i];
        if (s->state == S_STARTING && now - s->started_ms > SERVER_READY_MS) {
            ctl_log("Server %d did not connect back in time", (int)s->pid);
            kill(s->pid, SIGKILL);
            s->started_ms = now; /* killed once; the reaper ends it */
        }
    }
}

/* Stop every server, remove the socket and pid file; the caller exits. */
static void shut_down(double wait_s) {
    if (g_listen_fd >= 0) {
        close(g_listen_fd);
        g_listen_fd = -1;
    }
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &g_conns[i];
        if (c->fd >= 0 && c->waiting != W_NONE) {
            reply_error(c, "The MPS control daemon is shutting down");
            c->waiting = W_NONE;
            flush_conn(c);
        }
    }
    for (int i = 0; i < MAX_SERVERS; i++)
        if (g_servers[i].state != S_FREE) {
            g_servers[i].state = S_STOPPING;
            kill(g_servers[i].pid, SIGTERM);
        }
    long long deadline = now_ms() + (long long)(wait_s * 1000);
    while (live_server() != NULL) {
        reap();
        if (live_server() == NULL)
            break;
        if (now_ms() > deadline) {
            for (int i = 0; i < MAX_SERVERS; i++)
                if (g_servers[i].state != S_FREE) {
                    ctl_log("Server %d did not exit in time, killing it", (int)g_servers[i].pid);
                    kill(g_servers[i].pid, SIGKILL);
                }
            deadline = now_ms() + 5000;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    unlink(g_sock_path);
    unlink(g_pid_path);
    ctl_log("Exit");
}

/* --------------------------------------------------------------- commands */

static void cmd_help(struct conn *c) {
    static const char *lines[] = {
        "get_server_list",
        "get_server_status <PID>",
        "get_client_list <PID>",
        "start_server -uid <UID>",
        "shutdown_server <PID> [-f]",
        "quit [-t <TIMEOUT>]",
        "set_default_active_thread_percentage <percentage>",
        "get_default_active_thread_percentage",
        "get_active_thread_percentage <PID>",
        "set_default_device_pinned_mem_limit <dev> <value>",
        "get_default_device_pinned_mem_limit <dev>",
        "get_device_pinned_mem_limit <PID> <dev>",
    };
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
        reply_line(c, '|', "%s", lines[i]);
    reply_end(c, 1);
}

static int need_device(struct conn *c, const char *tok) {
    if (tok == NULL) {
        if (g_ndevices == 0) {
            reply_error(c, "Error: " NO_DEVICES_MESSAGE);
            return -1;
        }
        return 0;
    }
    int dev = find_device(tok);
    if (dev < 0)
        reply_error(c, "Error: invalid device %s", tok);
    return dev;
}

/* Handle one UI command; returns 1 if the connection must now wait for an event. */
static int ui_command(struct conn *c, char *line) {
    char *cmd = trim(line);
    if (*cmd == '\0')
        return 0;
    g_commands_seen++;
    record_command(c, cmd);
    ctl_log("Cmd:%s", cmd);
    if (g_crash_after >= 0 && g_commands_seen > g_crash_after)
        crash("FAKE_MPS_CRASH_AFTER reached");

    char copy[MAX_LINE];
    snprintf(copy, sizeof copy, "%s", cmd);
    char *argv[8] = {0};
    int argc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, " \t", &save); tok && argc < 8; tok = strtok_r(NULL, " \t", &save))
        argv[argc++] = tok;
    const char *name = argv[0];

    if (strcmp(name, "fake_crash") == 0)
        crash("fake_crash");
    if (strcmp(name, "fake_hang") == 0)
        hang();
    if (strcmp(name, "help") == 0) {
        cmd_help(c);
    } else if (strcmp(name, "get_default_active_thread_percentage") == 0 && argc == 1) {
        reply_line(c, '|', "%.1f", g_default_pct);
        reply_end(c, 1);
    } else if (strcmp(name, "set_default_active_thread_percentage") == 0 && argc == 2) {
        char *end;
        errno = 0;
        double v = strtod(argv[1], &end);
        if (errno || end == argv[1] || *end != '\0' || !(v >= 1.0 && v <= 100.0)) {
            reply_error(c, "Error: invalid active thread percentage %s (must be between 1 and 100)", argv[1]);
        } else {
            g_default_pct = v;
            reply_end(c, 1);
        }
    } else if (strcmp(name, "get_active_thread_percentage") == 0 && argc == 2) {
        struct server *s = server_by_token(argv[1]);
        if (s == NULL) {
            reply_error(c, "Error: no MPS server with PID %s", argv[1]);
        } else {
            reply_line(c, '|', "%.1f", s->pct);
            reply_end(c, 1);
        }
    } else if (strcmp(name, "set_default_device_pinned_mem_limit") == 0 && argc == 3) {
        int dev = need_device(c, argv[1]);
        char norm[LIMIT_LEN];
        unsigned long long bytes;
        if (dev < 0) {
            /* answered */
        } else if (parse_limit(argv[2], norm, &bytes) < 0) {
            reply_error(c, "Error: invalid memory limit %s (an integer followed by M or G)", argv[2]);
        } else {
            memcpy(g_devices[dev].limit, norm, LIMIT_LEN);
            reply_end(c, 1);
        }
    } else if (strcmp(name, "get_default_device_pinned_mem_limit") == 0 && argc <= 2) {
        int dev = need_device(c, argc == 2 ? argv[1] : NULL);
        if (dev >= 0) {
            reply_line(c, '|', "%s", g_devices[dev].limit[0] ? g_devices[dev].limit : "0");
            reply_end(c, 1);
        }
    } else if (strcmp(name, "get_device_pinned_mem_limit") == 0 && argc == 3) {
        struct server *s = server_by_token(argv[1]);
        if (s == NULL) {
            reply_error(c, "Error: no MPS server with PID %s", argv[1]);
        } else {
            int dev = need_device(c, argv[2]);
            if (dev >= 0) {
                reply_line(c, '|', "%s", s->limits[dev][0] ? s->limits[dev] : "0");
                reply_end(c, 1);
            }
        }
    } else if (strcmp(name, "get_server_list") == 0 && argc == 1) {
        for (int i = 0; i < MAX_SERVERS; i++)
            if (g_servers[i].state != S_FREE)
                reply_line(c, '|', "%d", (int)g_servers[i].pid);
        reply_end(c, 1);
    } else if (strcmp(name, "get_server_status") == 0 && argc == 2) {
        struct server *s = server_by_token(argv[1]);
        if (s == NULL) {
            reply_error(c, "Error: no MPS server with PID %s", argv[1]);
        } else {
            reply_line(c, '|', "%s",
                       s->state == S_READY      ? "ACTIVE"
                       : s->state == S_STARTING ? "INITIALIZING"
                                                : "SHUTTING_DOWN");
            reply_end(c, 1);
        }
    } else if (strcmp(name, "get_client_list") == 0 && argc == 2) {
        /* The fake CUDA clients still connected that were answered with this server. */
        const struct server *s = server_by_token(argv[1]);
        if (s == NULL) {
            reply_error(c, "Error: no MPS server with PID %s", argv[1]);
        } else {
            for (int i = 0; i < MAX_CONNS; i++)
                if (g_conns[i].fd >= 0 && g_conns[i].kind == C_CUDA && g_conns[i].served_by == s->pid)
                    reply_line(c, '|', "%d", (int)g_conns[i].pid);
            reply_end(c, 1);
        }
    } else if (strcmp(name, "shutdown_server") == 0 && (argc == 2 || (argc == 3 && strcmp(argv[2], "-f") == 0))) {
        struct server *s = server_by_token(argv[1]);
        if (s == NULL) {
            reply_error(c, "Error: no MPS server with PID %s", argv[1]);
        } else {
            s->state = S_STOPPING;
            kill(s->pid, argc == 3 ? SIGKILL : SIGTERM);
            /* Answered once it has exited, so that get_server_list no longer shows it. */
            c->waiting = W_EXIT;
            c->wait_pid = s->pid;
            return 1;
        }
    } else if (strcmp(name, "start_server") == 0 && argc == 3 && strcmp(argv[1], "-uid") == 0) {
        long uid;
        if (parse_long(argv[2], 0, (long)UINT_MAX - 1, &uid) < 0) {
            reply_error(c, "Error: invalid user id %s", argv[2]);
        } else {
            struct server *s = live_server();
            if (s != NULL && s->state == S_READY && s->uid == (uid_t)uid) {
                reply_end(c, 1);
            } else {
                wait_for_server(c, (uid_t)uid, gid_of((uid_t)uid));
                return 1;
            }
        }
    } else if (strcmp(name, "quit") == 0 && (argc == 1 || (argc == 3 && strcmp(argv[1], "-t") == 0))) {
        long timeout = -1;
        if (argc == 3 && parse_long(argv[2], 0, 86400, &timeout) < 0) {
            reply_error(c, "Error: invalid timeout %s", argv[2]);
            return 0;
        }
        shut_down(timeout >= 0 ? (double)timeout : QUIT_DEFAULT_WAIT_S);
        reply_end(c, 1);
        set_block(c->fd);
        if (c->outlen && write_all(c->fd, c->out, c->outlen) < 0) {
            /* the client went away: nothing to tell it */
        }
        exit(0);
    } else {
        reply_error(c, "Error: unknown command or wrong arguments: %s", cmd);
    }
    return 0;
}

/* A fake CUDA application: answer with the server for its user, starting one if needed. */
static void cuda_client(struct conn *c) {
    struct server *s = live_server();
    if (s != NULL && s->state == S_READY && s->uid == c->uid) {
        ctl_log("NEW CLIENT %d from user %u: Server already exists", (int)c->pid, (unsigned)c->uid);
        answer_cuda(c, s);
        return;
    }
    ctl_log("NEW CLIENT %d from user %u: Server is not ready, push client to pending list", (int)c->pid,
         (unsigned)c->uid);
    wait_for_server(c, c->uid, c->gid);
}

static void server_hello(struct conn *c) {
    struct server *s = find_server(c->pid);
    if (s == NULL || s->state != S_STARTING || s->uid != c->uid) {
        ctl_log("User did not send valid credentials");
        reply_end(c, 0);
        return;
    }
    s->state = S_READY;
    s->conn = (int)(c - g_conns);
    ctl_log("NEW SERVER %d: Ready", (int)s->pid);
    reply_end(c, 1);
    resolve_waiters(s);
}

/* Handle the complete lines buffered on a connection; returns -1 if it must be closed. */
static int process_lines(struct conn *c) {
    while (c->fd >= 0 && c->waiting == W_NONE) {
        char *nl = memchr(c->in, '\n', c->inlen);
        if (nl == NULL)
            return 0;
        *nl = '\0';
        char line[MAX_LINE];
        memcpy(line, c->in, (size_t)(nl - c->in) + 1);
        size_t used = (size_t)(nl - c->in) + 1;
        memmove(c->in, c->in + used, c->inlen - used);
        c->inlen -= used;
        switch (c->kind) {
        case C_NEW: {
            char *kind = trim(line);
            if (strcmp(kind, "ui") == 0) {
                c->kind = C_UI;
                ctl_log("NEW UI");
            } else if (strcmp(kind, "cuda") == 0) {
                c->kind = C_CUDA;
                cuda_client(c);
            } else if (strcmp(kind, "server") == 0) {
                c->kind = C_SERVER;
                server_hello(c);
            } else {
                ctl_log("User did not send valid credentials");
                return -1;
            }
            break;
        }
        case C_UI:
            ui_command(c, line);
            break;
        case C_CUDA:
        case C_SERVER:
            break; /* nothing more is expected from these */
        }
    }
    return 0;
}

static void on_readable(struct conn *c) {
    while (c->fd >= 0) {
        if (c->inlen == sizeof c->in) {
            if (c->kind == C_UI)
                reply_error(c, "Error: command line too long");
            flush_conn(c);
            close_conn(c);
            return;
        }
        ssize_t n = recv(c->fd, c->in + c->inlen, sizeof c->in - c->inlen, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (n <= 0) {
            if (c->kind == C_NEW)
                ctl_log("User did not send valid credentials");
            flush_conn(c);
            close_conn(c);
            return;
        }
        c->inlen += (size_t)n;
        if (process_lines(c) < 0) {
            close_conn(c);
            return;
        }
    }
}

static void accept_all(void) {
    for (;;) {
        int fd = accept4(g_listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        struct conn *c = NULL;
        for (int i = 0; i < MAX_CONNS && c == NULL; i++)
            if (g_conns[i].fd < 0)
                c = &g_conns[i];
        if (c == NULL) {
            close(fd);
            continue;
        }
        memset(c, 0, sizeof *c);
        c->fd = fd;
        c->kind = C_NEW;
        struct ucred cred;
        socklen_t len = sizeof cred;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
            c->pid = cred.pid;
            c->uid = cred.uid;
            c->gid = cred.gid;
        } else {
            c->uid = (uid_t)-1;
            c->gid = (gid_t)-1;
        }
        ctl_log("Accepting connection...");
    }
}

/* ----------------------------------------------------------------- daemon */

static void on_signal(int sig) {
    if (sig == SIGTERM || sig == SIGINT)
        g_term = 1;
    int saved = errno;
    if (write(g_sig_pipe[1], "s", 1) < 0) {
        /* full: a wakeup is pending anyway */
    }
    errno = saved;
}

/* Everything up to a listening socket; on failure a message in err. */
static int daemon_setup(char *err, size_t errlen) {
    if (sock_path() < 0) {
        snprintf(err, errlen, "The MPS pipe directory path is too long for a unix socket: %s/control", g_pipe_dir);
        return -1;
    }
    if (mkdir_p(g_pipe_dir, 0755) < 0) {
        snprintf(err, errlen, "Cannot create the pipe directory %s: %s", g_pipe_dir, strerror(errno));
        return -1;
    }
    if (mkdir_p(g_log_dir, 0755) < 0) {
        snprintf(err, errlen, "Cannot create the log directory %s: %s", g_log_dir, strerror(errno));
        return -1;
    }
    g_log_fd = open(g_control_log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (g_log_fd < 0) {
        snprintf(err, errlen, "Cannot open the log file %s: %s", g_control_log, strerror(errno));
        return -1;
    }
    int probe = connect_control();
    if (probe >= 0) {
        close(probe);
        snprintf(err, errlen, "An instance of this daemon is already running");
        return -1;
    }
    unlink(g_sock_path); /* a dead daemon's socket */
    g_listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, g_sock_path, strlen(g_sock_path) + 1);
    if (g_listen_fd < 0 || bind(g_listen_fd, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        chmod(g_sock_path, 0666) < 0) {
        snprintf(err, errlen, "Cannot listen on %s: %s", g_sock_path, strerror(errno));
        return -1;
    }
    if (pipe2(g_sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0) {
        snprintf(err, errlen, "pipe: %s", strerror(errno));
        unlink(g_sock_path);
        return -1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGHUP, SIG_IGN);

    parse_devices();
    const char *crash_after = getenv("FAKE_MPS_CRASH_AFTER");
    long n;
    if (crash_after && parse_long(crash_after, 0, LONG_MAX, &n) == 0)
        g_crash_after = n;
    for (int i = 0; i < MAX_CONNS; i++)
        g_conns[i].fd = -1;

    /* Pid file and start lines first: whoever can connect sees them already there. */
    int pid_fd = open(g_pid_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (pid_fd >= 0) {
        char buf[32];
        int len = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
        if (write(pid_fd, buf, (size_t)len) < 0) {
            /* the daemon still works without it */
        }
        close(pid_fd);
    }
    ctl_log("Starting control daemon using socket %s", g_sock_path);
    ctl_log("To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=%s", g_pipe_dir);
    ctl_log("CUDA MPS Control binary version: 0 (nvplug test stand-in)");
    if (listen(g_listen_fd, 128) < 0) {
        snprintf(err, errlen, "Cannot listen on %s: %s", g_sock_path, strerror(errno));
        unlink(g_sock_path);
        unlink(g_pid_path);
        return -1;
    }
    return 0;
}

__attribute__((noreturn)) static void daemon_loop(void) {
    struct pollfd pfds[MAX_CONNS + 2];
    int owner[MAX_CONNS + 2];
    for (;;) {
        if (g_term) {
            ctl_log("Received termination signal");
            shut_down(QUIT_DEFAULT_WAIT_S);
            exit(0);
        }
        int n = 0;
        pfds[n].fd = g_sig_pipe[0];
        pfds[n].events = POLLIN;
        owner[n++] = -1;
        pfds[n].fd = g_listen_fd;
        pfds[n].events = POLLIN;
        owner[n++] = -1;
        for (int i = 0; i < MAX_CONNS; i++) {
            if (g_conns[i].fd < 0)
                continue;
            pfds[n].fd = g_conns[i].fd;
            pfds[n].events = (short)(POLLIN | (g_conns[i].outlen ? POLLOUT : 0));
            owner[n++] = i;
        }
        int timeout = -1;
        for (int i = 0; i < MAX_SERVERS; i++)
            if (g_servers[i].state == S_STARTING) {
                long long left = g_servers[i].started_ms + SERVER_READY_MS + 1 - now_ms();
                int t = left < 0 ? 0 : (int)left;
                if (timeout < 0 || t < timeout)
                    timeout = t;
            }
        if (poll(pfds, (nfds_t)n, timeout) < 0 && errno != EINTR)
            crash("poll failed");
        if (pfds[0].revents) {
            char buf[64];
            while (read(g_sig_pipe[0], buf, sizeof buf) > 0) {
            }
        }
        reap();
        if (pfds[1].revents)
            accept_all();
        for (int k = 2; k < n; k++) {
            struct conn *c = &g_conns[owner[k]];
            if (c->fd != pfds[k].fd || pfds[k].revents == 0)
                continue;
            if (pfds[k].revents & (POLLIN | POLLHUP | POLLERR))
                on_readable(c);
            if (c->fd >= 0 && (pfds[k].revents & POLLOUT))
                flush_conn(c);
        }
        check_startup_deadlines();
        schedule();
        for (int i = 0; i < MAX_CONNS; i++)
            if (g_conns[i].fd >= 0 && g_conns[i].outlen)
                flush_conn(&g_conns[i]);
    }
}

static int run_foreground(void) {
    char err[PATH_MAX + 128];
    g_log_stderr = 1;
    if (daemon_setup(err, sizeof err) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    daemon_loop();
}

static int run_background(void) {
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) < 0) {
        perror("pipe");
        return 1;
    }
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    if (child == 0) {
        close(ready[0]);
        setsid();
        pid_t grandchild = fork();
        if (grandchild != 0)
            _exit(grandchild < 0 ? 1 : 0);
        if (chdir("/") < 0) {
            /* paths are absolute already */
        }
        stdio_to_devnull();
        char err[PATH_MAX + 128];
        err[0] = 'E';
        if (daemon_setup(err + 1, sizeof err - 1) < 0) {
            if (write_all(ready[1], err, strlen(err)) < 0) {
                /* the parent reports a silent failure */
            }
            _exit(1);
        }
        /* The parent returns once the socket listens, as the real -d does. */
        if (write_all(ready[1], "R", 1) < 0) {
            /* the parent is gone: run anyway */
        }
        close(ready[1]);
        daemon_loop();
    }
    close(ready[1]);
    int status;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    char buf[PATH_MAX + 128];
    size_t got = 0;
    for (;;) {
        ssize_t n = read(ready[0], buf + got, sizeof buf - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    buf[got] = '\0';
    if (got > 0 && buf[0] == 'R')
        return 0;
    fprintf(stderr, "%s\n", got > 1 ? buf + 1 : "The MPS control daemon failed to start");
    return 1;
}

/* ----------------------------------------------------------------- client */

/* Read one answer; prints it; returns 0 (success), 1 (error answer) or -1 (connection lost). */
static int read_answer(int fd, char *buf, size_t size, size_t *len, FILE *out, FILE *err) {
    for (;;) {
        char *nl;
        while ((nl = memchr(buf, '\n', *len)) != NULL) {
            *nl = '\0';
            int result = -2;
            if (buf[0] == '|' && buf[1] == ' ')
                fprintf(out, "%s\n", buf + 2);
            else if (buf[0] == '!' && buf[1] == ' ')
                fprintf(err, "%s\n", buf + 2);
            else if (buf[0] == '=')
                result = strcmp(buf, "= 0") == 0 ? 0 : 1;
            size_t used = (size_t)(nl - buf) + 1;
            memmove(buf, buf + used, *len - used);
            *len -= used;
            if (result != -2) {
                fflush(out);
                fflush(err);
                return result;
            }
        }
        if (*len == size)
            return -1;
        ssize_t n = read(fd, buf + *len, size - *len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        *len += (size_t)n;
    }
}

static int run_client(void) {
    if (sock_path() < 0) {
        fprintf(stderr, "Cannot find MPS control daemon process\n");
        return 1;
    }
    int fd = connect_control();
    if (fd < 0) {
        fprintf(stderr, "Cannot find MPS control daemon process\n");
        return 1;
    }
    if (write_all(fd, "ui\n", 3) < 0) {
        fprintf(stderr, "Cannot find MPS control daemon process\n");
        return 1;
    }
    static char line[MAX_LINE + 2];
    static char answer[MAX_OUT];
    size_t alen = 0;
    int status = 0;
    while (fgets(line, sizeof line - 1, stdin) != NULL) {
        char *cmd = trim(line);
        if (*cmd == '\0')
            continue;
        size_t len = strlen(cmd);
        cmd[len++] = '\n';
        if (write_all(fd, cmd, len) < 0) {
            fprintf(stderr, "Lost the connection to the MPS control daemon\n");
            return 1;
        }
        int r = read_answer(fd, answer, sizeof answer, &alen, stdout, stdout);
        if (r < 0) {
            fprintf(stderr, "Lost the connection to the MPS control daemon\n");
            return 1;
        }
        if (r > 0)
            status = 1;
    }
    close(fd);
    return status;
}

static int run_fake_cuda_client(int hold, const char *held_file) {
    if (sock_path() < 0) {
        fprintf(stderr, "fake CUDA client: the pipe directory path is too long\n");
        return 1;
    }
    /* A first connection that sends no credentials, as the CUDA driver's probe. */
    int probe = connect_control();
    if (probe < 0) {
        fprintf(stderr, "fake CUDA client: cannot connect to the MPS control daemon at %s: %s\n", g_sock_path,
                strerror(errno));
        return 1;
    }
    close(probe);
    int fd = connect_control();
    if (fd < 0 || write_all(fd, "cuda\n", 5) < 0) {
        fprintf(stderr, "fake CUDA client: cannot connect to the MPS control daemon at %s: %s\n", g_sock_path,
                strerror(errno));
        return 1;
    }
    static char answer[MAX_LINE * 4];
    size_t alen = 0;
    int r = read_answer(fd, answer, sizeof answer, &alen, stdout, stderr);
    if (r < 0)
        fprintf(stderr, "fake CUDA client: the MPS control daemon closed the connection\n");
    else if (r > 0)
        fprintf(stderr, "fake CUDA client: cudaErrorMpsConnectionFailed\n");
    if (r != 0 || !hold)
        return r == 0 ? 0 : 1;
    /* A CUDA process keeps its context on the server, and its segments in /dev/shm, until it ends. */
    int held = held_file ? open(held_file, O_RDWR | O_CREAT | O_CLOEXEC, 0600) : -1;
    if (held_file && held < 0) {
        fprintf(stderr, "fake CUDA client: cannot make %s: %s\n", held_file, strerror(errno));
        return 1;
    }
    printf("holding the connection\n");
    fflush(stdout);
    char byte;
    ssize_t n;
    while ((n = read(fd, &byte, 1)) < 0 && errno == EINTR) {
    }
    /* Nothing is ever sent after the answer: this is the daemon going away, contexts lost. */
    fprintf(stderr, "fake CUDA client: cudaErrorMpsConnectionFailed: the MPS server went away\n");
    return 1;
}

static void usage(FILE *out) {
    fprintf(out,
            "Usage: nvidia-cuda-mps-control [-d | -f | -h]\n"
            "  -d, --daemon       start the MPS control daemon in the background\n"
            "  -f, --foreground   start the MPS control daemon in the foreground\n"
            "  -h, --help         print this message\n"
            "  --fake-cuda-client test stand-in only: connect like a CUDA application\n"
            "  --fake-cuda-client --hold [FILE]  ... and stay connected, holding FILE open\n"
            "Without an option, read commands from standard input and send them to the daemon.\n"
            "Environment: CUDA_MPS_PIPE_DIRECTORY (default " DEFAULT_PIPE_DIR "), CUDA_MPS_LOG_DIRECTORY (default "
            DEFAULT_LOG_DIR "), CUDA_VISIBLE_DEVICES.\n"
            "This is nvplug's test stand-in, not NVIDIA's tool.\n");
}

int main(int argc, char **argv) {
    set_paths();
    if (argc == 1)
        return run_client();
    const char *opt = argv[1];
    if (argc == 2 && (strcmp(opt, "-h") == 0 || strcmp(opt, "--help") == 0)) {
        usage(stdout);
        return 0;
    }
    if (argc == 2 && (strcmp(opt, "-d") == 0 || strcmp(opt, "--daemon") == 0))
        return run_background();
    if (argc == 2 && (strcmp(opt, "-f") == 0 || strcmp(opt, "--foreground") == 0))
        return run_foreground();
    if (argc == 2 && strcmp(opt, "--fake-cuda-client") == 0)
        return run_fake_cuda_client(0, NULL);
    if ((argc == 3 || argc == 4) && strcmp(opt, "--fake-cuda-client") == 0 && strcmp(argv[2], "--hold") == 0)
        return run_fake_cuda_client(1, argc == 4 ? argv[3] : NULL);
    fprintf(stderr, "Unknown option: %s\n", opt);
    usage(stderr);
    return 1;
}
