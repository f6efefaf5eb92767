/*
 * regbench: what a careful program does by hand to get SIZE bytes of
 * pinned shared memory on the soft backend, timed: a memfd (or a file
 * on a tmpfs, e.g. one mounted huge=always), ftruncate, mmap, then, with
 * THREADS > 1, the pages populated by that many threads
 * (MADV_POPULATE_WRITE) before one mlock; with THREADS = 1, mlock alone
 * (it faults every page itself). Prints the seconds from ftruncate to
 * the end of mlock.
 *
 * usage: regbench SIZE THREADS [FILE]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define CHUNK (16UL << 20)

static char *base;
static size_t size, nchunks;
static size_t next_chunk;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void *populate(void *arg)
{
	(void)arg;
	for (;;) {
		pthread_mutex_lock(&mu);
		size_t i = next_chunk++;
		pthread_mutex_unlock(&mu);
		if (i >= nchunks)
			return NULL;
		size_t off = i * CHUNK, n = size - off < CHUNK ? size - off : CHUNK;
		if (madvise(base + off, n, MADV_POPULATE_WRITE) != 0) {
			perror("madvise(MADV_POPULATE_WRITE)");
			exit(1);
		}
	}
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: regbench SIZE THREADS [FILE]\n");
		return 2;
	}
	size = strtoull(argv[1], NULL, 0);
	int threads = atoi(argv[2]);
	int fd = argc > 3 ? open(argv[3], O_RDWR | O_CREAT | O_TRUNC, 0600) : memfd_create("regbench", 0);
	if (fd < 0 || threads < 1) {
		perror("open");
		return 1;
	}
	double start = now();
	if (ftruncate(fd, size) != 0) {
		perror("ftruncate");
		return 1;
	}
	base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (base == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	if (threads > 1) {
		nchunks = (size + CHUNK - 1) / CHUNK;
		pthread_t t[threads];
		for (int i = 0; i < threads; i++)
			pthread_create(&t[i], NULL, populate, NULL);
		for (int i = 0; i < threads; i++)
			pthread_join(t[i], NULL);
	}
	if (mlock(base, size) != 0) {
		perror("mlock");
		return 1;
	}
	printf("%.6f\n", now() - start);
	munlock(base, size);
	munmap(base, size);
	close(fd);
	if (argc > 3)
		unlink(argv[3]);
	return 0;
}
