/*
 * mrfs test client in C.
 *
 *   client [--hold] PATH SIZE
 *
 * Opens PATH with O_CREAT|O_RDWR, ftruncates it to SIZE, maps it MAP_SHARED,
 * fills the mapping with the test pattern, writes "mrfs" at offset 0 with
 * pwrite(2) (and checks the mapping shows it), reads user.mrfs.rkey with
 * getxattr(2) and prints:
 *
 *   rkey=<value>
 *   addr=0x<address of the mapping>
 *
 * With --hold it then prints "ready" and serves commands on stdin, one per
 * line: "check" answers "ok" when the mapping still holds the data, else
 * "bad <offset>"; "quit" (or EOF) unmaps, closes and exits 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

static unsigned char pattern(size_t i) {
	return (unsigned char)((i * 131 + (i >> 12) + 7) & 0xff);
}

static const char header[] = "mrfs";

static long check(const unsigned char *p, size_t size) {
	for (size_t i = 0; i < size; i++) {
		unsigned char want = i < 4 ? (unsigned char)header[i] : pattern(i);
		if (p[i] != want)
			return (long)i;
	}
	return -1;
}

int main(int argc, char **argv) {
	int hold = 0;
	int arg = 1;
	if (argc > 1 && strcmp(argv[1], "--hold") == 0) {
		hold = 1;
		arg++;
	}
	if (argc - arg != 2) {
		fprintf(stderr, "usage: client [--hold] PATH SIZE\n");
		return 2;
	}
	const char *path = argv[arg];
	size_t size = strtoull(argv[arg + 1], NULL, 0);
	if (size < 4) {
		fprintf(stderr, "SIZE must be at least 4\n");
		return 2;
	}

	int fd = open(path, O_CREAT | O_RDWR, 0600);
	if (fd < 0) {
		perror("open");
		return 1;
	}
	if (ftruncate(fd, (off_t)size) != 0) {
		perror("ftruncate");
		return 1;
	}
	unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	for (size_t i = 0; i < size; i++)
		p[i] = pattern(i);
	if (pwrite(fd, header, 4, 0) != 4) {
		perror("pwrite");
		return 1;
	}
	if (memcmp(p, header, 4) != 0) {
		fprintf(stderr, "pwrite not visible through the mapping\n");
		return 3;
	}

	char rkey[128];
	ssize_t n = getxattr(path, "user.mrfs.rkey", rkey, sizeof rkey - 1);
	if (n < 0) {
		perror("getxattr user.mrfs.rkey");
		return 1;
	}
	rkey[n] = '\0';
	printf("rkey=%s\n", rkey);
	printf("addr=0x%lx\n", (unsigned long)p);
	fflush(stdout);

	if (hold) {
		char line[64];
		printf("ready\n");
		fflush(stdout);
		while (fgets(line, sizeof line, stdin) != NULL) {
			if (strncmp(line, "quit", 4) == 0)
				break;
			if (strncmp(line, "check", 5) == 0) {
				long bad = check(p, size);
				if (bad < 0)
					printf("ok\n");
				else
					printf("bad %ld\n", bad);
				fflush(stdout);
			}
		}
	}

	if (munmap(p, size) != 0) {
		perror("munmap");
		return 1;
	}
	if (close(fd) != 0) {
		perror("close");
		return 1;
	}
	return 0;
}
