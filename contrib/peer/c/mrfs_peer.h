/*
 * mrfs_peer.h: a peer of mrfs in C, over rdma_cm (librdmacm, libibverbs).
 *
 * It connects to an mrfs mount's rdma_cm listener with the connect format
 * of docs/REMOTE.md (the PD's directory and its token in the private data),
 * gets a queue pair in that directory's PD, and posts one-sided READ, WRITE,
 * compare-and-swap and fetch-and-add against the buffers of that PD, one at
 * a time, waiting for each completion. Local memory is registered inside.
 *
 *     struct mrfs_peer *p;
 *     if (mrfs_connect(&p, "10.0.0.5:7471", "/", getenv("MRFS_TOKEN")) ||
 *         mrfs_write_desc(p, desc, 0, "hello", 5))
 *             fprintf(stderr, "mrfs: %s\n", mrfs_error());
 *     mrfs_close(p);
 *
 * Build: cc -std=c11 -O2 -Icontrib/peer/c prog.c contrib/peer/c/mrfs_peer.c
 *        -lrdmacm -libverbs   (Debian: librdmacm-dev, libibverbs-dev)
 *
 * Every function returning int returns 0 when it is done; a positive
 * enum ibv_wc_status when the operation completed with that status
 * (IBV_WC_REM_ACCESS_ERR, 10: a wrong rkey, a range outside the region,
 * a missing access flag; the queue pair is then in the error state, as
 * any RC queue pair, and later operations complete with
 * IBV_WC_WR_FLUSH_ERR, 5: connect again to go on); a negative errno when
 * it failed before any completion (-EACCES: mrfs refused the token or the
 * peer's address; -ENOENT: no such directory; -ETIMEDOUT ...).
 * mrfs_error() says what failed, for the calling thread's last failure.
 * A connection is not for several threads at once.
 */
#ifndef MRFS_PEER_H
#define MRFS_PEER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct mrfs_peer;

/* Connects to the mrfs at peer ("HOST:PORT", the second word of the
 * mount's user.mrfs.remote; "[v6]:PORT") in the PD of the directory pd
 * ("/" is the root; at most 34 bytes), presenting token (that
 * directory's user.mrfs.token: 32 hex digits). Each step waits at most
 * 10 s. On success *p is the connection; on failure *p is NULL. */
int mrfs_connect(struct mrfs_peer **p, const char *peer, const char *pd, const char *token);

/* Frees everything of the connection (disconnects first). NULL is fine. */
void mrfs_close(struct mrfs_peer *p);

/* The name of mrfs's device the connection came through, from its
 * accept; "" when mrfs did not say. On a mount of several devices only
 * that device's keys (the desc's "devices") work on the connection. */
const char *mrfs_device(const struct mrfs_peer *p);

/* The calling thread's last failure, in words. */
const char *mrfs_error(void);

/* The name of an enum ibv_wc_status ("IBV_WC_REM_ACCESS_ERR"). */
const char *mrfs_status_name(int status);

/* One-sided operations at a remote address with the rkey of the region
 * holding it (user.mrfs.addr and user.mrfs.rkey, or a desc's). READ and
 * WRITE move at most 2 GiB. The atomics work on the 8-byte aligned word
 * at addr, in the target's byte order (the host's, on one architecture),
 * and store the word's old value in *old. */
int mrfs_write(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, const void *data, size_t len);
int mrfs_read(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, void *dst, size_t len);
int mrfs_compare_swap(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, uint64_t compare, uint64_t swap,
		      uint64_t *old);
int mrfs_fetch_add(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, uint64_t add, uint64_t *old);

/* The same at an offset of the buffer a desc names (its user.mrfs.desc,
 * the JSON text as mrfs writes it): a range is split at the desc's
 * regions, each part with its region's rkey (the regions of
 * mrfs_device()'s entry of "devices" when the desc has one), an atomic
 * goes to the region holding its word; a range past the buffer is
 * -ERANGE. */
int mrfs_write_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, const void *data, size_t len);
int mrfs_read_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, void *dst, size_t len);
int mrfs_compare_swap_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, uint64_t compare, uint64_t swap,
			   uint64_t *old);
int mrfs_fetch_add_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, uint64_t add, uint64_t *old);

#ifdef __cplusplus
}
#endif

#endif
