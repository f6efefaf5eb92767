/*
 * selftest.c: checks mrfs_peer against a live mount on an RDMA device
 * (tests/vm/guest/peers_test.go runs it on Soft-RoCE).
 *
 * usage: MRFS_TOKEN=... ./selftest HOST:PORT PD DESC_FILE
 * build: cc -std=c11 -Wall -Wextra -Werror -o selftest selftest.c mrfs_peer.c -lrdmacm -libverbs
 * The buffer must have remote read, write and atomic access and be at
 * least 16 KiB. Prints one line per check; exits 1 at the first failure.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "mrfs_peer.h"

static void check(const char *what, int ok)
{
	printf("%s%s\n", ok ? "ok   " : "FAIL ", what);
	if (!ok) {
		printf("     last error: %s\n", mrfs_error());
		exit(1);
	}
}

static char desc[1 << 16], big[8192], back[8192];

int main(int argc, char **argv)
{
	FILE *f = argc == 4 ? fopen(argv[3], "r") : NULL;
	if (!f || !fread(desc, 1, sizeof desc - 1, f)) {
		fprintf(stderr, "usage: MRFS_TOKEN=... selftest HOST:PORT PD DESC_FILE\n");
		return 2;
	}
	const char *peer = argv[1], *pd = argv[2], *token = getenv("MRFS_TOKEN");
	struct mrfs_peer *p;
	uint64_t old, zero = 0, word;

	check("connect with the directory's token", mrfs_connect(&p, peer, pd, token) == 0);
	printf("     through mrfs's device %s\n", mrfs_device(p));
	check("the accept names mrfs's device", mrfs_device(p)[0] != 0);

	/* Top-level addr and rkey: the first region's, as user.mrfs.addr and
	 * user.mrfs.rkey. */
	char *a = strstr(desc, "\"addr\":\""), *k = strstr(desc, "\"rkey\":\"");
	check("the desc has addr and rkey", a && k);
	uint64_t addr = strtoull(a + 8, NULL, 0);
	uint32_t rkey = (uint32_t)strtoul(k + 8, NULL, 0);

	check("WRITE", mrfs_write(p, addr + 100, rkey, "rdma_cm peer in C", 17) == 0);
	check("READ returns what WRITE put",
	      mrfs_read(p, addr + 100, rkey, back, 17) == 0 && !memcmp(back, "rdma_cm peer in C", 17));
	check("WRITE of zero bytes", mrfs_write(p, addr, rkey, "", 0) == 0);
	check("WRITE a zero word", mrfs_write(p, addr, rkey, &zero, 8) == 0);
	check("FETCH_AND_ADD returns the old value", mrfs_fetch_add(p, addr, rkey, 5, &old) == 0 && old == 0);
	check("COMPARE_AND_SWAP returns the old value", mrfs_compare_swap(p, addr, rkey, 5, 42, &old) == 0 && old == 5);
	check("a COMPARE_AND_SWAP that does not match swaps nothing",
	      mrfs_compare_swap(p, addr, rkey, 5, 7, &old) == 0 && old == 42);
	check("the atomics' word is in host order", mrfs_read(p, addr, rkey, &word, 8) == 0 && word == 42);
	check("FETCH_AND_ADD by the desc",
	      mrfs_fetch_add_desc(p, desc, 0, 1, &old) == 0 && old == 42 && mrfs_read(p, addr, rkey, &word, 8) == 0 &&
		      word == 43);
	check("COMPARE_AND_SWAP by the desc", mrfs_compare_swap_desc(p, desc, 0, 43, 7, &old) == 0 && old == 43);

	for (size_t i = 0; i < sizeof big; i++)
		big[i] = (char)(i * 7);
	check("write_desc and read_desc by the desc's regions",
	      mrfs_write_desc(p, desc, 4096, big, sizeof big) == 0 &&
		      mrfs_read_desc(p, desc, 4096, back, sizeof big) == 0 && !memcmp(big, back, sizeof big));
	check("a range past the buffer is refused (ERANGE)", mrfs_read_desc(p, desc, 1ull << 40, back, 1) == -ERANGE);

	int r = mrfs_read(p, addr, rkey ^ 1, back, 8);
	printf("     %s\n", mrfs_error());
	check("a wrong rkey completes with IBV_WC_REM_ACCESS_ERR",
	      r == IBV_WC_REM_ACCESS_ERR && strstr(mrfs_error(), "IBV_WC_REM_ACCESS_ERR"));
	check("after an error the queue pair flushes (IBV_WC_WR_FLUSH_ERR)",
	      mrfs_read(p, addr, rkey, back, 8) == IBV_WC_WR_FLUSH_ERR);
	mrfs_close(p);

	r = mrfs_connect(&p, peer, pd, "00000000000000000000000000000000");
	printf("     %s\n", mrfs_error());
	check("a wrong token is refused with EACCES", r == -EACCES && !p);
	r = mrfs_connect(&p, peer, "nosuchdir", token);
	printf("     %s\n", mrfs_error());
	check("an unknown directory is refused with ENOENT", r == -ENOENT && !p);
	check("a token that is not 32 hex digits is refused (EINVAL)", mrfs_connect(&p, peer, pd, "0123") == -EINVAL);
	return 0;
}
