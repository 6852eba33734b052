/* A crash keeps what was fsynced. LD_PRELOADed into a test's own valkey-server, this
 * notes, after each fdatasync/fsync that succeeded, the file's size when the call began
 * (at least that much of it is on disk) in $FSYNC_LOG: "<size> <path>" per line. The
 * chaos tier cuts the AOF back to it to simulate a host crash (tests/servers.py). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static void note(int fd, off_t size) {
    const char *log = getenv("FSYNC_LOG");
    char link[64], path[4096];
    if (log == NULL || size < 0) return;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    int out = open(log, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (out < 0) return;
    dprintf(out, "%lld %s\n", (long long)size, path);
    close(out);
}

static off_t size_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? st.st_size : -1;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    off_t size = size_of(fd);
    int rc = real(fd);
    if (rc == 0) note(fd, size);
    return rc;
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    off_t size = size_of(fd);
    int rc = real(fd);
    if (rc == 0) note(fd, size);
    return rc;
}
