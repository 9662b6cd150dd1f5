// SPDX-License-Identifier: GPL-2.0
/*
 * /init of the boot test run by `kernel-patches/check --boot`.
 *
 * Runs as PID 1 in a tiny initramfs under qemu, with the ext4 image on an
 * emulated NVMe disk.  It sets I/O lineage tags with prctl(PR_IO_TAG), writes
 * files whose data reaches the disk through writeback, and checks that the
 * tags come back in the block:block_ai_rq_complete tracepoint:
 *
 *   A  written with tag A, tag cleared, then sync(): the flusher writes the
 *      data, so the completions must carry tag A and a flusher pid.
 *   B  written with tag B, then the task switches to tag C and calls fsync():
 *      the data must complete with tag B (the dirtier), never C.
 *   D  a file with the user.ai.checkpoint xattr, written with tag D, must be
 *      reported by writeback:ai_checkpoint_write; a file without it must not.
 *   E  with fail_io_timeout, the completion of one O_DIRECT read tagged E is
 *      dropped, so nvme_timeout() runs for it: nvme:nvme_ai_timeout must
 *      report an abort and then a controller reset, both with tag E.
 *
 * It also checks the events of the other patches when their tracefs
 * directories exist, dumps every event's tracefs `format`, and prints one
 * line "stall-recorder boot test: PASS" or "... FAIL" that the script greps.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#ifndef PR_IO_TAG
#define PR_IO_TAG 0x494f5447
#define PR_IO_TAG_SET 0
#define PR_IO_TAG_GET 1
#endif

#define TRACEFS "/sys/kernel/tracing"
#define TAG_A 0x5a5a00000000a001ULL
#define TAG_B 0x5a5a00000000b002ULL
#define TAG_C 0x5a5a00000000c003ULL
#define TAG_D 0x5a5a00000000d004ULL
#define TAG_E 0x5a5a00000000e005ULL
#define DEBUGFS "/sys/kernel/debug"
#define FILE_BYTES (1024 * 1024)

static int failures;

static void check(int ok, const char *fmt, ...)
{
	va_list ap;

	printf("%s: ", ok ? "ok" : "FAILED");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	if (!ok)
		failures++;
}

static void die(const char *what)
{
	printf("stall-recorder boot test: FAIL (%s: %s)\n", what, strerror(errno));
	fflush(stdout);
	sync();
	reboot(RB_AUTOBOOT);
	exit(1);
}

static int write_file(const char *path, const char *value)
{
	int fd = open(path, O_WRONLY | O_TRUNC);
	ssize_t n;

	if (fd < 0)
		return -1;
	n = write(fd, value, strlen(value));
	close(fd);
	return n == (ssize_t)strlen(value) ? 0 : -1;
}

static void cat_file(const char *path)
{
	char buf[4096];
	ssize_t n;
	int fd = open(path, O_RDONLY);

	if (fd < 0)
		return;
	while ((n = read(fd, buf, sizeof(buf))) > 0)
		fwrite(buf, 1, n, stdout);
	close(fd);
}

static void set_tag(uint64_t tag)
{
	if (prctl(PR_IO_TAG, PR_IO_TAG_SET, (unsigned long)tag, 0, 0))
		die("prctl(PR_IO_TAG_SET)");
}

static void write_data(const char *path, int do_fsync, uint64_t tag_before_fsync)
{
	static char buf[FILE_BYTES];
	int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);

	if (fd < 0)
		die(path);
	memset(buf, 0xa5, sizeof(buf));
	if (write(fd, buf, sizeof(buf)) != sizeof(buf))
		die("write");
	if (do_fsync) {
		set_tag(tag_before_fsync);
		if (fsync(fd))
			die("fsync");
	}
	close(fd);
}

/* One parsed block_ai_rq_complete line. */
struct completion {
	char rwbs[16];
	unsigned long long sector, io_tag;
	unsigned int nr_sector, nr_bytes;
	int error, pid, tid;
};

static char trace_buf[8 << 20];

static size_t read_trace(void)
{
	size_t len = 0;
	ssize_t n;
	int fd = open(TRACEFS "/trace", O_RDONLY);

	if (fd < 0)
		die("open trace");
	while (len < sizeof(trace_buf) - 1 &&
	       (n = read(fd, trace_buf + len, sizeof(trace_buf) - 1 - len)) > 0)
		len += n;
	close(fd);
	trace_buf[len] = '\0';
	return len;
}

static int dir_exists(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static void enable_event(const char *sys_event)
{
	char path[256];

	snprintf(path, sizeof(path), TRACEFS "/events/%s/enable", sys_event);
	if (write_file(path, "1"))
		die(path);
}

static void dump_format(const char *sys_event)
{
	char path[256];

	snprintf(path, sizeof(path), TRACEFS "/events/%s/format", sys_event);
	printf("=== format %s ===\n", sys_event);
	cat_file(path);
	printf("=== end format ===\n");
}

/* Trace lines that contain @needle and, when not NULL, @also and @also2. */
static int count_lines_all(const char *needle, const char *also, const char *also2)
{
	int n = 0;
	char *line = trace_buf, *end;

	for (; line && *line; line = end ? end + 1 : NULL) {
		end = strchr(line, '\n');
		if (end)
			*end = '\0';
		if (strstr(line, needle) && (!also || strstr(line, also)) &&
		    (!also2 || strstr(line, also2)))
			n++;
		if (end)
			*end = '\n';
	}
	return n;
}

static void stop_losing_completions(void)
{
	write_file("/sys/block/nvme0n1/io-timeout-fail", "0");
	write_file(DEBUGFS "/fail_io_timeout/probability", "0");
	write_file("/sys/block/nvme0n1/queue/io_timeout", "30000");
}

/*
 * Make the completion of the next request on nvme0n1 get lost, read one block
 * of @path with O_DIRECT under tag E in a child, and wait for it (the driver
 * aborts the command, then resets the controller, then the read is retried).
 * Returns 0 if the read finished within a minute.
 */
static int lost_completion_read(const char *path)
{
	int status, i, fd;
	void *buf;
	pid_t child;

	if (write_file("/sys/block/nvme0n1/queue/io_timeout", "1000") ||
	    write_file(DEBUGFS "/fail_io_timeout/probability", "100") ||
	    write_file(DEBUGFS "/fail_io_timeout/interval", "1") ||
	    write_file(DEBUGFS "/fail_io_timeout/times", "1") ||
	    write_file(DEBUGFS "/fail_io_timeout/verbose", "1"))
		die("configure fail_io_timeout");
	if (posix_memalign(&buf, 4096, 4096))
		die("posix_memalign");
	sync();
	if (write_file("/sys/block/nvme0n1/io-timeout-fail", "1"))
		die("io-timeout-fail");
	child = fork();
	if (child < 0)
		die("fork");
	if (child == 0) {
		set_tag(TAG_E);
		fd = open(path, O_RDONLY | O_DIRECT);
		_exit(fd >= 0 && pread(fd, buf, 4096, 0) == 4096 ? 0 : 1);
	}
	for (i = 0; i < 600; i++) {
		if (waitpid(child, &status, WNOHANG) == child) {
			stop_losing_completions();
			printf("lost-completion read finished after %d.%ds, status %d\n",
			       i / 10, i % 10, WEXITSTATUS(status));
			return 0;
		}
		usleep(100000);
	}
	stop_losing_completions();
	return -1;
}

static int count_lines(const char *needle, const char *also)
{
	return count_lines_all(needle, also, NULL);
}

static void print_lines(const char *needle)
{
	char *line = trace_buf, *end;

	for (; line && *line; line = end ? end + 1 : NULL) {
		end = strchr(line, '\n');
		if (end)
			*end = '\0';
		if (strstr(line, needle))
			printf("%s\n", line);
		if (end)
			*end = '\n';
	}
}

int main(void)
{
	static const char * const events[] = {
		"block/block_ai_rq_complete",
		"nvme/nvme_ai_timeout",
		"dma/dma_ai_map_latency",
		"writeback/ai_checkpoint_write",
	};
	int a_writes = 0, a_flusher = 0, b_writes = 0, c_data = 0, total = 0;
	int disk_reset = 0;
	unsigned long long got = 0;
	pid_t self = getpid();
	char *line, *end;
	unsigned int i;
	int tries;

	mkdir("/dev", 0755);
	mkdir("/proc", 0755);
	mkdir("/sys", 0755);
	mkdir("/mnt", 0755);
	if (mount("devtmpfs", "/dev", "devtmpfs", 0, NULL) && errno != EBUSY)
		die("mount /dev");
	if (mount("proc", "/proc", "proc", 0, NULL))
		die("mount /proc");
	if (mount("sysfs", "/sys", "sysfs", 0, NULL))
		die("mount /sys");
	if (mount("tracefs", TRACEFS, "tracefs", 0, NULL) && errno != EBUSY)
		die("mount tracefs");

	for (tries = 0; access("/dev/nvme0n1", F_OK); tries++) {
		if (tries == 300)
			die("no /dev/nvme0n1");
		usleep(100000);
	}
	/* noatime: a read must not dirty the inode and start a journal commit. */
	if (mount("/dev/nvme0n1", "/mnt", "ext4", MS_NOATIME, NULL))
		die("mount /dev/nvme0n1");
	if (mount("debugfs", DEBUGFS, "debugfs", 0, NULL) && errno != EBUSY)
		printf("debugfs not mounted: %s\n", strerror(errno));

	for (i = 0; i < sizeof(events) / sizeof(events[0]); i++) {
		char dir[256];

		snprintf(dir, sizeof(dir), TRACEFS "/events/%s", events[i]);
		if (!dir_exists(dir)) {
			printf("event %s: not present\n", events[i]);
			continue;
		}
		dump_format(events[i]);
		enable_event(events[i]);
	}
	write_file(TRACEFS "/buffer_size_kb", "4096");
	write_file(TRACEFS "/tracing_on", "1");

	/* A: dirtied with tag A, written back by the flusher on sync(). */
	set_tag(TAG_A);
	write_data("/mnt/a", 0, 0);
	set_tag(0);
	sync();

	/* B: dirtied with tag B, fsync()ed by the same task now tagged C. */
	set_tag(TAG_B);
	write_data("/mnt/b", 1, TAG_C);

	if (prctl(PR_IO_TAG, PR_IO_TAG_GET, &got, 0, 0))
		die("prctl(PR_IO_TAG_GET)");
	check(got == TAG_C, "PR_IO_TAG_GET returns the tag set last (%#llx)", got);

	/* D: the checkpoint write trace, for a file opted in by xattr. */
	set_tag(TAG_D);
	close(open("/mnt/ckpt", O_CREAT | O_WRONLY, 0644));
	if (setxattr("/mnt/ckpt", "user.ai.checkpoint", "1", 1, 0))
		die("setxattr user.ai.checkpoint");
	write_data("/mnt/ckpt", 0, 0);
	write_data("/mnt/plain", 0, 0);
	set_tag(0);
	sync();

	/*
	 * E: a request whose completion is lost, handled by nvme_timeout().
	 * Last, because after the controller reset it provokes, qemu's NVMe
	 * model (7.2, INTx) stops completing writes: nothing may be written
	 * to the disk afterwards, not even by umount.
	 */
	if (dir_exists(TRACEFS "/events/nvme/nvme_ai_timeout") &&
	    dir_exists(DEBUGFS "/fail_io_timeout")) {
		check(lost_completion_read("/mnt/plain") == 0,
		      "read with a lost completion finished after timeout handling");
		disk_reset = 1;
	}

	write_file(TRACEFS "/tracing_on", "0");
	read_trace();

	for (line = trace_buf; line && *line; line = end ? end + 1 : NULL) {
		struct completion c;
		char *ev;

		end = strchr(line, '\n');
		if (end)
			*end = '\0';
		ev = strstr(line, "block_ai_rq_complete: ");
		if (ev && sscanf(ev + strlen("block_ai_rq_complete: "),
				 "%*d,%*d %15s %llu + %u bytes=%u [%d] io_tag=%llu pid=%d tid=%d",
				 c.rwbs, &c.sector, &c.nr_sector, &c.nr_bytes,
				 &c.error, &c.io_tag, &c.pid, &c.tid) == 8) {
			int is_write = strchr(c.rwbs, 'W') != NULL;

			total++;
			if (is_write && c.io_tag == TAG_A) {
				a_writes++;
				if (c.pid != self)
					a_flusher++;
			}
			if (is_write && c.io_tag == TAG_B)
				b_writes++;
			if (is_write && c.nr_bytes && c.io_tag == TAG_C)
				c_data++;
			printf("completion: %s sector=%llu bytes=%u io_tag=%#llx pid=%d tid=%d\n",
			       c.rwbs, c.sector, c.nr_bytes, c.io_tag, c.pid, c.tid);
		}
		if (end)
			*end = '\n';
	}

	check(total > 0, "block_ai_rq_complete fired (%d completions)", total);
	check(a_writes > 0, "writes dirtied with tag A complete with tag A (%d)", a_writes);
	check(a_flusher > 0, "tag A writes were submitted by writeback, not by pid %d (%d)",
	      self, a_flusher);
	check(b_writes > 0, "fsync() writes carry the dirtier's tag B (%d)", b_writes);
	check(c_data == 0, "no data write carries the fsync caller's tag C (%d)", c_data);

	if (dir_exists(TRACEFS "/events/writeback/ai_checkpoint_write")) {
		char want[64];

		snprintf(want, sizeof(want), "io_tag=%llu", TAG_D);
		check(count_lines("ai_checkpoint_write:", want) > 0,
		      "ai_checkpoint_write reports the opted-in file with tag D");
		check(count_lines("ai_checkpoint_write:", "name=plain") == 0,
		      "ai_checkpoint_write ignores files without the xattr");
	}
	if (dir_exists(TRACEFS "/events/nvme/nvme_ai_timeout") &&
	    dir_exists(DEBUGFS "/fail_io_timeout")) {
		char want[64];

		snprintf(want, sizeof(want), "io_tag=%llu", TAG_E);
		check(count_lines_all("nvme_ai_timeout:", "action=abort", want) > 0,
		      "nvme_ai_timeout reports the abort of the tag E request");
		check(count_lines_all("nvme_ai_timeout:", "action=reset", want) > 0,
		      "nvme_ai_timeout reports the controller reset for the tag E request");
	}
	if (dir_exists(TRACEFS "/events/dma/dma_ai_map_latency")) {
		int maps = count_lines("dma_ai_map_latency:", NULL);
		int bounced = count_lines("dma_ai_map_latency:", "bounced=1");
		int force = 0;
		int fd = open("/proc/cmdline", O_RDONLY);
		char cmdline[1024] = "";

		if (fd >= 0) {
			if (read(fd, cmdline, sizeof(cmdline) - 1) < 0)
				cmdline[0] = '\0';
			close(fd);
		}
		/* swiotlb=force or swiotlb=<slabs>,force */
		force = strstr(cmdline, "swiotlb=force") || strstr(cmdline, ",force");
		check(maps > 0, "dma_ai_map_latency fired (%d maps)", maps);
		if (force)
			check(bounced > 0, "swiotlb=force: bounced maps reported (%d)", bounced);
		else
			printf("swiotlb not forced: bounces not checked\n");
	}

	printf("=== trace: nvme_ai_timeout and ai_checkpoint_write ===\n");
	print_lines("nvme_ai_timeout:");
	print_lines("ai_checkpoint_write:");
	printf("=== trace excerpt ===\n");
	for (i = 0, line = trace_buf; line && *line && i < 40; i++) {
		end = strchr(line, '\n');
		if (!end)
			break;
		if (line[0] != '#')
			fwrite(line, 1, end - line + 1, stdout);
		line = end + 1;
	}
	printf("=== end trace excerpt ===\n");

	printf("stall-recorder boot test: %s (%d failed checks)\n",
	       failures ? "FAIL" : "PASS", failures);
	fflush(stdout);
	if (!disk_reset) {
		umount("/mnt");
		sync();
	}
	reboot(RB_AUTOBOOT);
	return 0;
}
