/*
 * mrfs_peer.c: a peer of mrfs over rdma_cm. See mrfs_peer.h for the API
 * and docs/REMOTE.md for the connect format it speaks.
 */
#define _POSIX_C_SOURCE 200809L

#include "mrfs_peer.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

enum {
	TIMEOUT_MS = 10000,
	VERSION = 2,	 /* of the private data: with the token */
	HEADER = 22,	 /* "MRFS", version, 16 token bytes, path length */
	MAX_PRIVATE = 56, /* what a connect request carries over IB and RoCE */
	DEPTH = 16,	 /* send queue and completion queue */
};
#define MAX_MESSAGE (1ull << 31) /* the largest RDMA message (IB spec, rxe) */

struct mrfs_peer {
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	int connected;
	int broken; /* an operation timed out: its completion may still come */
	void *mem;  /* the local buffer that operations go through */
	size_t size;
	struct ibv_mr *mr;
	uint64_t wr_id;
	char device[64];
};

static _Thread_local char errbuf[512];

const char *mrfs_error(void) { return errbuf; }

__attribute__((format(printf, 2, 3))) static int fail(int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(errbuf, sizeof errbuf, fmt, ap);
	va_end(ap);
	return code;
}

const char *mrfs_status_name(int status)
{
#define S(x) [x] = #x
	static const char *const names[] = {
		S(IBV_WC_SUCCESS), S(IBV_WC_LOC_LEN_ERR), S(IBV_WC_LOC_QP_OP_ERR), S(IBV_WC_LOC_EEC_OP_ERR),
		S(IBV_WC_LOC_PROT_ERR), S(IBV_WC_WR_FLUSH_ERR), S(IBV_WC_MW_BIND_ERR), S(IBV_WC_BAD_RESP_ERR),
		S(IBV_WC_LOC_ACCESS_ERR), S(IBV_WC_REM_INV_REQ_ERR), S(IBV_WC_REM_ACCESS_ERR), S(IBV_WC_REM_OP_ERR),
		S(IBV_WC_RETRY_EXC_ERR), S(IBV_WC_RNR_RETRY_EXC_ERR), S(IBV_WC_LOC_RDD_VIOL_ERR),
		S(IBV_WC_REM_INV_RD_REQ_ERR), S(IBV_WC_REM_ABORT_ERR), S(IBV_WC_INV_EECN_ERR),
		S(IBV_WC_INV_EEC_STATE_ERR), S(IBV_WC_FATAL_ERR), S(IBV_WC_RESP_TIMEOUT_ERR), S(IBV_WC_GENERAL_ERR),
	};
#undef S
	if (status >= 0 && (size_t)status < sizeof names / sizeof names[0] && names[status])
		return names[status];
	return "IBV_WC_STATUS_UNKNOWN";
}

/* --- connecting ----------------------------------------------------------- */

static int hexdigit(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* hello writes the connect request's private data: "MRFS", the version,
 * the token's 16 bytes, the path's length and the path. */
static int hello(uint8_t *b, const char *pd, const char *token)
{
	size_t n = strlen(pd);
	if (n > MAX_PRIVATE - HEADER)
		return fail(-ENAMETOOLONG, "directory \"%s\" is %zu bytes; a connect request carries at most %d", pd, n,
			    MAX_PRIVATE - HEADER);
	if (!token)
		return fail(-EINVAL, "no token (the directory's user.mrfs.token; is MRFS_TOKEN set?)");
	/* Blanks around the digits are fine, as in a token file. */
	token += strspn(token, " \t\r\n");
	memcpy(b, "MRFS", 4);
	b[4] = VERSION;
	for (int i = 0; i < 16; i++) {
		int hi = hexdigit(token[2 * i]), lo = hi < 0 ? -1 : hexdigit(token[2 * i + 1]);
		if (lo < 0)
			return fail(-EINVAL, "a token is 32 hex digits");
		b[5 + i] = (uint8_t)(hi << 4 | lo);
	}
	if (token[32 + strspn(token + 32, " \t\r\n")])
		return fail(-EINVAL, "a token is 32 hex digits");
	b[21] = (uint8_t)n;
	memcpy(b + HEADER, pd, n);
	return (int)(HEADER + n);
}

/* What the connection keeps of an rdma_cm event: it is acknowledged at
 * once, and its private data goes with the acknowledgement. */
struct event {
	enum rdma_cm_event_type type;
	int status;
	uint8_t data[256];
	size_t len;
};

static int next_event(struct mrfs_peer *p, struct event *e)
{
	struct pollfd pfd = {.fd = p->ch->fd, .events = POLLIN};
	struct rdma_cm_event *ev;
	int n = poll(&pfd, 1, TIMEOUT_MS);
	if (n <= 0)
		return n ? fail(-errno, "waiting for rdma_cm: %s", strerror(errno))
			 : fail(-ETIMEDOUT, "no rdma_cm event within %d ms", TIMEOUT_MS);
	if (rdma_get_cm_event(p->ch, &ev))
		return fail(-errno, "rdma_get_cm_event: %s", strerror(errno));
	e->type = ev->event;
	e->status = ev->status;
	e->len = 0;
	if (ev->param.conn.private_data) { /* at most 255 bytes: its length is a uint8_t */
		e->len = ev->param.conn.private_data_len;
		memcpy(e->data, ev->param.conn.private_data, e->len);
	}
	rdma_ack_cm_event(ev);
	return 0;
}

static int expect(struct mrfs_peer *p, enum rdma_cm_event_type want)
{
	struct event e;
	int r = next_event(p, &e);
	if (r)
		return r;
	if (e.type != want)
		return fail(-EHOSTUNREACH, "%s (status %d), want %s", rdma_event_str(e.type), e.status,
			    rdma_event_str(want));
	return 0;
}

/* rejected reads a reject's private data: "MRFS", the version, an errno
 * (big endian 16 bits), the length of a message and the message. */
static int rejected(const struct event *e)
{
	const uint8_t *b = e->data;
	if (e->len < 8 || memcmp(b, "MRFS", 4) || b[4] != VERSION)
		return fail(-ECONNREFUSED, "rejected (status %d): nothing listens there, or not mrfs", e->status);
	int err = b[5] << 8 | b[6];
	size_t n = b[7] < e->len - 8 ? b[7] : e->len - 8;
	return fail(-err, "mrfs refused the connection: %.*s (%s)", (int)n, (const char *)b + 8, strerror(err));
}

/* grow makes the registered local buffer at least n bytes. */
static int grow(struct mrfs_peer *p, size_t n)
{
	if (n <= p->size)
		return 0;
	n = (n + 4095) & ~(size_t)4095;
	if (p->mr)
		ibv_dereg_mr(p->mr);
	free(p->mem);
	p->mr = NULL;
	p->size = 0;
	if (posix_memalign(&p->mem, 4096, n)) {
		p->mem = NULL;
		return fail(-ENOMEM, "no memory for a local buffer of %zu bytes", n);
	}
	/* Local write: READs and atomics land here. */
	if (!(p->mr = ibv_reg_mr(p->pd, p->mem, n, IBV_ACCESS_LOCAL_WRITE))) {
		int err = errno;
		return fail(-err, "register a local buffer of %zu bytes: %s%s", n, strerror(err),
			    err == ENOMEM || err == EPERM ? " (is RLIMIT_MEMLOCK too low? see ulimit -l)" : "");
	}
	p->size = n;
	return 0;
}

static int dial(struct mrfs_peer *p, const char *peer, const char *pd, const char *token)
{
	uint8_t priv[MAX_PRIVATE];
	int n = hello(priv, pd, token);
	if (n < 0)
		return n;

	/* HOST:PORT, the host maybe in brackets (IPv6). */
	char host[256];
	const char *colon = strrchr(peer, ':');
	size_t hl = colon ? (size_t)(colon - peer) : 0;
	if (!colon || hl >= sizeof host)
		return fail(-EINVAL, "want HOST:PORT");
	if (hl >= 2 && peer[0] == '[' && peer[hl - 1] == ']')
		memcpy(host, peer + 1, hl -= 2);
	else
		memcpy(host, peer, hl);
	host[hl] = 0;
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai;
	int r = getaddrinfo(host, colon + 1, &hints, &ai);
	if (r)
		return fail(-EHOSTUNREACH, "%s", gai_strerror(r));

	if (!(p->ch = rdma_create_event_channel()))
		r = fail(-errno, "rdma_create_event_channel: %s", strerror(errno));
	else if (rdma_create_id(p->ch, &p->id, NULL, RDMA_PS_TCP))
		r = fail(-errno, "rdma_create_id: %s", strerror(errno));
	else if (rdma_resolve_addr(p->id, NULL, ai->ai_addr, TIMEOUT_MS))
		r = fail(-errno, "rdma_resolve_addr: %s", strerror(errno));
	freeaddrinfo(ai);
	if (r || (r = expect(p, RDMA_CM_EVENT_ADDR_RESOLVED)))
		return r;
	if (rdma_resolve_route(p->id, TIMEOUT_MS))
		return fail(-errno, "rdma_resolve_route: %s", strerror(errno));
	if ((r = expect(p, RDMA_CM_EVENT_ROUTE_RESOLVED)))
		return r;

	/* A PD of our own on the device the route goes through, and a
	 * completion channel, so that a wait can be bounded. */
	struct ibv_context *dev = p->id->verbs;
	if (!(p->pd = ibv_alloc_pd(dev)))
		return fail(-errno, "ibv_alloc_pd: %s", strerror(errno));
	if (!(p->cc = ibv_create_comp_channel(dev)))
		return fail(-errno, "ibv_create_comp_channel: %s", strerror(errno));
	if (!(p->cq = ibv_create_cq(dev, DEPTH, NULL, p->cc, 0)))
		return fail(-errno, "ibv_create_cq: %s", strerror(errno));
	if ((r = ibv_req_notify_cq(p->cq, 0)))
		return fail(-r, "ibv_req_notify_cq: %s", strerror(r));
	if ((r = grow(p, 64 << 10)))
		return r;
	struct ibv_qp_init_attr qa = {
		.send_cq = p->cq,
		.recv_cq = p->cq,
		.qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = DEPTH, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1},
	};
	if (rdma_create_qp(p->id, p->pd, &qa))
		return fail(-errno, "rdma_create_qp: %s", strerror(errno));

	/* Initiator depth 1: this side issues READs and atomics (one at a
	 * time), which mrfs's queue pair then takes. */
	struct rdma_conn_param cp = {
		.private_data = priv,
		.private_data_len = (uint8_t)n,
		.initiator_depth = 1,
		.retry_count = 7,
		.rnr_retry_count = 7,
	};
	if (rdma_connect(p->id, &cp))
		return fail(-errno, "rdma_connect: %s", strerror(errno));
	struct event e;
	if ((r = next_event(p, &e)))
		return r;
	if (e.type == RDMA_CM_EVENT_REJECTED)
		return rejected(&e);
	if (e.type != RDMA_CM_EVENT_ESTABLISHED)
		return fail(-ECONNREFUSED, "%s (status %d), want RDMA_CM_EVENT_ESTABLISHED", rdma_event_str(e.type),
			    e.status);
	p->connected = 1;
	/* The accept names mrfs's device: "MRFS", the version, its length. */
	if (e.len >= 6 && !memcmp(e.data, "MRFS", 4) && e.data[4] == VERSION && e.data[5] < sizeof p->device &&
	    6u + e.data[5] <= e.len)
		memcpy(p->device, e.data + 6, e.data[5]);
	return 0;
}

int mrfs_connect(struct mrfs_peer **out, const char *peer, const char *pd, const char *token)
{
	struct mrfs_peer *p = calloc(1, sizeof *p);
	*out = NULL;
	if (!p)
		return fail(-ENOMEM, "no memory");
	int r = dial(p, peer, pd, token);
	if (r) {
		char why[sizeof errbuf];
		memcpy(why, errbuf, sizeof why);
		snprintf(errbuf, sizeof errbuf, "connect to mrfs at %s (pd \"%s\"): %.400s", peer, pd, why);
		mrfs_close(p);
		return r;
	}
	*out = p;
	return 0;
}

const char *mrfs_device(const struct mrfs_peer *p) { return p->device; }

void mrfs_close(struct mrfs_peer *p)
{
	if (!p)
		return;
	if (p->connected)
		rdma_disconnect(p->id);
	if (p->id && p->id->qp)
		rdma_destroy_qp(p->id);
	if (p->mr)
		ibv_dereg_mr(p->mr);
	free(p->mem);
	if (p->cq)
		ibv_destroy_cq(p->cq);
	if (p->cc)
		ibv_destroy_comp_channel(p->cc);
	if (p->pd)
		ibv_dealloc_pd(p->pd);
	/* Last: the device is the id's. */
	if (p->id)
		rdma_destroy_id(p->id);
	if (p->ch)
		rdma_destroy_event_channel(p->ch);
	free(p);
}

/* --- operations ------------------------------------------------------------ */

/* wait_wc waits for the next completion, TIMEOUT_MS at most. */
static int wait_wc(struct mrfs_peer *p, struct ibv_wc *wc)
{
	struct pollfd pfd = {.fd = p->cc->fd, .events = POLLIN};
	struct ibv_cq *cq;
	void *ctx;
	for (;;) {
		int n = ibv_poll_cq(p->cq, 1, wc);
		if (n)
			return n < 0 ? -EIO : 0;
		/* Armed before this poll: a completion since raises an event. */
		n = poll(&pfd, 1, TIMEOUT_MS);
		if (n <= 0)
			return n ? -errno : -ETIMEDOUT;
		if (ibv_get_cq_event(p->cc, &cq, &ctx))
			return -errno;
		ibv_ack_cq_events(cq, 1);
		if ((n = ibv_req_notify_cq(p->cq, 0)))
			return -n;
	}
}

/* post posts wr on len bytes of the local buffer and waits for its
 * completion. */
static int post(struct mrfs_peer *p, const char *name, struct ibv_send_wr *wr, size_t len, uint64_t addr,
		uint32_t rkey)
{
	struct ibv_sge sge = {.addr = (uintptr_t)p->mem, .length = (uint32_t)len, .lkey = p->mr->lkey};
	struct ibv_send_wr *bad;
	struct ibv_wc wc;
	if (p->broken)
		return fail(-EIO, "%s: an earlier operation timed out; connect again", name);
	wr->wr_id = ++p->wr_id;
	wr->sg_list = &sge;
	wr->num_sge = len ? 1 : 0;
	wr->send_flags = IBV_SEND_SIGNALED;
	int r = ibv_post_send(p->id->qp, wr, &bad);
	if (r)
		return fail(-r, "%s at 0x%llx rkey 0x%x: ibv_post_send: %s", name, (unsigned long long)addr, rkey,
			    strerror(r));
	if ((r = wait_wc(p, &wc))) {
		p->broken = 1;
		return fail(r, "%s at 0x%llx rkey 0x%x: waiting for its completion: %s", name,
			    (unsigned long long)addr, rkey, strerror(-r));
	}
	if (wc.status != IBV_WC_SUCCESS)
		return fail((int)wc.status, "%s at 0x%llx rkey 0x%x: %s (%s)", name, (unsigned long long)addr, rkey,
			    mrfs_status_name(wc.status), ibv_wc_status_str(wc.status));
	return 0;
}

int mrfs_write(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, const void *data, size_t len)
{
	struct ibv_send_wr wr = {.opcode = IBV_WR_RDMA_WRITE, .wr.rdma = {.remote_addr = addr, .rkey = rkey}};
	int r;
	if (len > MAX_MESSAGE)
		return fail(-EMSGSIZE, "RDMA WRITE of %zu bytes: at most 2 GiB", len);
	if ((r = grow(p, len)))
		return r;
	memcpy(p->mem, data, len);
	return post(p, "RDMA WRITE", &wr, len, addr, rkey);
}

int mrfs_read(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, void *dst, size_t len)
{
	struct ibv_send_wr wr = {.opcode = IBV_WR_RDMA_READ, .wr.rdma = {.remote_addr = addr, .rkey = rkey}};
	int r;
	if (len > MAX_MESSAGE)
		return fail(-EMSGSIZE, "RDMA READ of %zu bytes: at most 2 GiB", len);
	if ((r = grow(p, len)) || (r = post(p, "RDMA READ", &wr, len, addr, rkey)))
		return r;
	memcpy(dst, p->mem, len);
	return 0;
}

/* The old value lands in the local buffer, in the target's order. */
static int atomic(struct mrfs_peer *p, const char *name, struct ibv_send_wr *wr, uint64_t *old)
{
	int r = post(p, name, wr, 8, wr->wr.atomic.remote_addr, wr->wr.atomic.rkey);
	if (!r)
		memcpy(old, p->mem, 8);
	return r;
}

int mrfs_compare_swap(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, uint64_t compare, uint64_t swap,
		      uint64_t *old)
{
	struct ibv_send_wr wr = {.opcode = IBV_WR_ATOMIC_CMP_AND_SWP,
				 .wr.atomic = {.remote_addr = addr, .compare_add = compare, .swap = swap, .rkey = rkey}};
	return atomic(p, "ATOMIC_CMP_AND_SWP", &wr, old);
}

int mrfs_fetch_add(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, uint64_t add, uint64_t *old)
{
	struct ibv_send_wr wr = {.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD,
				 .wr.atomic = {.remote_addr = addr, .compare_add = add, .rkey = rkey}};
	return atomic(p, "ATOMIC_FETCH_AND_ADD", &wr, old);
}

/* --- descs ------------------------------------------------------------------
 * Just enough JSON to read a desc: objects, arrays, strings, and the
 * numbers mrfs writes as strings ("0x7f..", "65536"). */

static const char *ws(const char *s) { return s + strspn(s, " \t\r\n"); }

/* skip returns the end of the JSON value at s, NULL if there is none. */
static const char *skip(const char *s)
{
	s = ws(s);
	if (*s == '"') {
		for (s++; *s != '"'; s++)
			if (!*s || (*s == '\\' && !*++s))
				return NULL;
		return s + 1;
	}
	if (*s == '{' || *s == '[') {
		char end = *s == '{' ? '}' : ']';
		if (*(s = ws(s + 1)) == end)
			return s + 1;
		for (;;) {
			if (end == '}' && (*s != '"' || !(s = skip(s)) || *(s = ws(s)) != ':'))
				return NULL;
			if (end == '}')
				s++;
			if (!(s = skip(s)))
				return NULL;
			if (*(s = ws(s)) == end)
				return s + 1;
			if (*s != ',')
				return NULL;
			s = ws(s + 1);
		}
	}
	size_t n = strcspn(s, ",:]} \t\r\n");
	return n ? s + n : NULL;
}

/* member returns the value of key in the object at s, NULL if none. */
static const char *member(const char *s, const char *key)
{
	size_t n = strlen(key);
	if (!s || *(s = ws(s)) != '{')
		return NULL;
	for (s = ws(s + 1); *s == '"';) {
		const char *k = s + 1, *v;
		if (!(s = skip(s)) || *ws(s) != ':')
			return NULL;
		v = ws(ws(s) + 1);
		if ((size_t)(s - 1 - k) == n && !memcmp(k, key, n))
			return v;
		if (!(s = skip(v)) || *(s = ws(s)) != ',')
			return NULL;
		s = ws(s + 1);
	}
	return NULL;
}

/* element returns the first element of the array at s (i == 0) or the
 * one after the element at s (i == 1); NULL at the end. */
static const char *element(const char *s, int i)
{
	if (!s)
		return NULL;
	if (i == 0)
		return *(s = ws(s)) == '[' && *(s = ws(s + 1)) != ']' ? s : NULL;
	return (s = skip(s)) && *(s = ws(s)) == ',' ? ws(s + 1) : NULL;
}

/* number reads a number written as a string ("0x1000", "4096"). */
static int number(const char *v, uint64_t *out)
{
	char *end;
	if (!v || *v != '"' || v[1] == '-')
		return -1;
	errno = 0;
	*out = strtoull(v + 1, &end, 0);
	return errno || end == v + 1 || *end != '"' ? -1 : 0;
}

/* regions is the desc's regions that work on p: those of its device's
 * entry of "devices" when there is one, else the desc's own. */
static const char *regions(struct mrfs_peer *p, const char *desc)
{
	const char *d = member(desc, "devices");
	size_t n = strlen(p->device);
	if (!d || !n)
		return member(desc, "regions");
	for (d = element(d, 0); d; d = element(d, 1)) {
		const char *name = member(d, "device");
		if (name && *name == '"' && !strncmp(name + 1, p->device, n) && name[1 + n] == '"')
			return member(d, "regions");
	}
	return NULL;
}

typedef int (*part_fn)(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, char *buf, size_t len);

/* span runs op on each part of [offset, offset+len) of the buffer a desc
 * names that one region holds, in messages of at most MAX_MESSAGE, once
 * it has checked that the regions cover all of it; without op, it only
 * checks. */
static int span(struct mrfs_peer *p, const char *desc, uint64_t offset, size_t len, char *buf, part_fn op)
{
	uint64_t addr, size;
	if (number(member(desc, "addr"), &addr) || number(member(desc, "length"), &size))
		return fail(-EINVAL, "not a desc of mrfs: no addr or length");
	if (offset > size || len > size - offset)
		return fail(-ERANGE, "range %llu+%zu is past the buffer's %llu bytes", (unsigned long long)offset, len,
			    (unsigned long long)size);
	const char *regs = regions(p, desc);
	if (!regs)
		return fail(-EINVAL, "the desc has no regions of device \"%s\"", p->device);
	uint64_t start = addr + offset, end = start + len;
	for (int pass = 0; pass < (op ? 2 : 1); pass++) {
		uint64_t done = 0;
		for (const char *r = element(regs, 0); r; r = element(r, 1)) {
			uint64_t ra, rn, rkey;
			if (number(member(r, "addr"), &ra) || number(member(r, "length"), &rn) ||
			    number(member(r, "rkey"), &rkey))
				return fail(-EINVAL, "a region of the desc lacks addr, length or rkey");
			uint64_t lo = ra > start ? ra : start, hi = ra + rn < end ? ra + rn : end;
			for (; lo < hi; lo += hi - lo < MAX_MESSAGE ? hi - lo : MAX_MESSAGE) {
				size_t m = hi - lo < MAX_MESSAGE ? hi - lo : MAX_MESSAGE;
				int rc = pass ? op(p, lo, (uint32_t)rkey, buf + (lo - start), m) : 0;
				if (rc)
					return rc;
				done += m;
			}
		}
		if (done != len)
			return fail(-ERANGE, "range %llu+%zu is not covered by the desc's regions",
				    (unsigned long long)offset, len);
	}
	return 0;
}

static int write_part(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, char *buf, size_t len)
{
	return mrfs_write(p, addr, rkey, buf, len);
}

static int read_part(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, char *buf, size_t len)
{
	return mrfs_read(p, addr, rkey, buf, len);
}

int mrfs_write_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, const void *data, size_t len)
{
	/* (write_part only reads buf.) */
	return span(p, desc, offset, len, (char *)(uintptr_t)data, write_part);
}

int mrfs_read_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, void *dst, size_t len)
{
	return span(p, desc, offset, len, dst, read_part);
}

/* at finds the address of offset in the buffer a desc names and the
 * rkey of the region holding it (the one part of a 1-byte span), once
 * the 8-byte word there is in the buffer: an aligned word is in one
 * region, which starts on a page boundary, but a pool slot's region is
 * its chunk's, which goes on past the slot. */
struct at {
	uint64_t addr;
	uint32_t rkey;
};

static int at_part(struct mrfs_peer *p, uint64_t addr, uint32_t rkey, char *buf, size_t len)
{
	struct at *a = (struct at *)(void *)buf;
	(void)p;
	(void)len;
	a->addr = addr;
	a->rkey = rkey;
	return 0;
}

int mrfs_compare_swap_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, uint64_t compare, uint64_t swap,
			   uint64_t *old)
{
	struct at a;
	int r = span(p, desc, offset, 8, NULL, NULL);
	if (!r)
		r = span(p, desc, offset, 1, (char *)&a, at_part);
	return r ? r : mrfs_compare_swap(p, a.addr, a.rkey, compare, swap, old);
}

int mrfs_fetch_add_desc(struct mrfs_peer *p, const char *desc, uint64_t offset, uint64_t add, uint64_t *old)
{
	struct at a;
	int r = span(p, desc, offset, 8, NULL, NULL);
	if (!r)
		r = span(p, desc, offset, 1, (char *)&a, at_part);
	return r ? r : mrfs_fetch_add(p, a.addr, a.rkey, add, old);
}
