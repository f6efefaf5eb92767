//go:build rdma

package ibv

// This is the package's only cgo file: thin wrappers that call one
// libibverbs or librdmacm function each and return Go values and a
// syscall.Errno. All decisions live in the pure-Go files. No Go pointer
// is ever kept by C: the Go memory C sees is out-parameters and inputs
// of one call (a length, an address's bytes, private data that librdmacm
// copies, an event record C fills), and memory to register or to use as a
// work request's local buffer is the caller's mmap, passed as an integer.

/*
#cgo LDFLAGS: -libverbs -lrdmacm
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <netinet/in.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

// The address to register arrives as an integer (the caller's mapping,
// never Go memory) and becomes a pointer only on the C side.
static struct ibv_mr *mrfs_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t length,
				  uint64_t iova, unsigned int access)
{
	return ibv_reg_mr_iova2(pd, (void *)addr, length, iova, access);
}

// mrfs_sockaddr fills ss from an address's bytes (4 or 16) and a port.
static socklen_t mrfs_sockaddr(struct sockaddr_storage *ss, const uint8_t *ip, int iplen, uint16_t port)
{
	memset(ss, 0, sizeof(*ss));
	if (iplen == 4) {
		struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
		s4->sin_family = AF_INET;
		s4->sin_port = htons(port);
		memcpy(&s4->sin_addr, ip, 4);
		return sizeof(*s4);
	}
	struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
	s6->sin6_family = AF_INET6;
	s6->sin6_port = htons(port);
	memcpy(&s6->sin6_addr, ip, 16);
	return sizeof(*s6);
}

static int mrfs_bind_addr(struct rdma_cm_id *id, const uint8_t *ip, int iplen, uint16_t port)
{
	struct sockaddr_storage ss;
	mrfs_sockaddr(&ss, ip, iplen, port);
	return rdma_bind_addr(id, (struct sockaddr *)&ss);
}

static int mrfs_resolve_addr(struct rdma_cm_id *id, const uint8_t *ip, int iplen, uint16_t port, int timeout_ms)
{
	struct sockaddr_storage ss;
	mrfs_sockaddr(&ss, ip, iplen, port);
	return rdma_resolve_addr(id, NULL, (struct sockaddr *)&ss, timeout_ms);
}

static int mrfs_create_id(struct rdma_event_channel *ch, struct rdma_cm_id **id)
{
	return rdma_create_id(ch, id, NULL, RDMA_PS_TCP);
}

// mrfs_event is what mrfs keeps of an rdma_cm_event: the event is
// acknowledged before the Go side acts on it (rdma_destroy_id waits for
// the acknowledgement of its id's events, so an unacknowledged event
// held while tearing down would deadlock), and the private data it
// points to goes with the acknowledgement, hence the copy.
struct mrfs_event {
	int type;
	int status;
	struct rdma_cm_id *id;
	struct rdma_cm_id *listen_id;
	uint8_t initiator_depth;
	uint8_t responder_resources;
	int private_len;
	uint8_t private_data[256];
};

static int mrfs_get_event(struct rdma_event_channel *ch, struct mrfs_event *out)
{
	struct rdma_cm_event *ev;
	if (rdma_get_cm_event(ch, &ev))
		return -1;
	memset(out, 0, sizeof(*out));
	out->type = ev->event;
	out->status = ev->status;
	out->id = ev->id;
	out->listen_id = ev->listen_id;
	if (ev->id && ev->id->ps == RDMA_PS_TCP) {
		const struct rdma_conn_param *c = &ev->param.conn;
		out->initiator_depth = c->initiator_depth;
		out->responder_resources = c->responder_resources;
		if (c->private_data && c->private_data_len) {
			out->private_len = c->private_data_len;
			memcpy(out->private_data, c->private_data, c->private_data_len);
		}
	}
	return rdma_ack_cm_event(ev);
}

static int mrfs_connect(struct rdma_cm_id *id, const void *priv, uint8_t priv_len,
			uint8_t responder_resources, uint8_t initiator_depth)
{
	struct rdma_conn_param p;
	memset(&p, 0, sizeof(p));
	p.private_data = priv;
	p.private_data_len = priv_len;
	p.responder_resources = responder_resources;
	p.initiator_depth = initiator_depth;
	p.retry_count = 7;
	p.rnr_retry_count = 7;
	return rdma_connect(id, &p);
}

static int mrfs_accept(struct rdma_cm_id *id, uint8_t responder_resources, uint8_t initiator_depth)
{
	struct rdma_conn_param p;
	memset(&p, 0, sizeof(p));
	p.responder_resources = responder_resources;
	p.initiator_depth = initiator_depth;
	p.rnr_retry_count = 7;
	return rdma_accept(id, &p);
}

static int mrfs_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq, uint32_t depth)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = depth;
	a.cap.max_recv_wr = 1;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	return rdma_create_qp(id, pd, &a);
}

// mrfs_create_own_qp creates an RC QP in pd that librdmacm does not
// manage (id->qp stays NULL), so that mrfs sets its access flags itself.
static struct ibv_qp *mrfs_create_own_qp(struct ibv_pd *pd, struct ibv_cq *cq, uint32_t depth)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = depth;
	a.cap.max_recv_wr = 1;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	return ibv_create_qp(pd, &a);
}

// mrfs_ready_qp moves a QP that librdmacm does not manage through INIT,
// RTR and RTS with the attributes the connection manager gives for id
// (rdma_init_qp_attr), as rdma_accept would, except that INIT carries
// access: the remote access the QP allows. Returns 0, or -1 with errno.
static int mrfs_ready_qp(struct rdma_cm_id *id, struct ibv_qp *qp, int access, uint8_t resp_res)
{
	struct ibv_qp_attr a;
	int mask, r;

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	if (rdma_init_qp_attr(id, &a, &mask))
		return -1;
	a.qp_access_flags = access;
	mask |= IBV_QP_ACCESS_FLAGS;
	if ((r = ibv_modify_qp(qp, &a, mask))) {
		errno = r;
		return -1;
	}
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	if (rdma_init_qp_attr(id, &a, &mask))
		return -1;
	a.max_dest_rd_atomic = resp_res;
	if ((r = ibv_modify_qp(qp, &a, mask))) {
		errno = r;
		return -1;
	}
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	if (rdma_init_qp_attr(id, &a, &mask))
		return -1;
	a.max_rd_atomic = 0;
	if ((r = ibv_modify_qp(qp, &a, mask))) {
		errno = r;
		return -1;
	}
	return 0;
}

// mrfs_qp_error moves a QP to ERROR (what rdma_disconnect does for a
// QP it manages).
static int mrfs_qp_error(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

static int mrfs_accept_qpn(struct rdma_cm_id *id, uint32_t qpn, uint8_t responder_resources,
			   const void *priv, uint8_t priv_len)
{
	struct rdma_conn_param p;
	memset(&p, 0, sizeof(p));
	p.private_data = priv;
	p.private_data_len = priv_len;
	p.responder_resources = responder_resources;
	p.initiator_depth = 0;
	p.rnr_retry_count = 7;
	p.qp_num = qpn;
	return rdma_accept(id, &p);
}

static const char *mrfs_id_device(struct rdma_cm_id *id)
{
	if (!id->verbs)
		return NULL;
	return ibv_get_device_name(id->verbs->device);
}

// mrfs_cm_keep keeps librdmacm's reference (rdma_get_devices) on
// list[keep] alone and gives the others back, so that a device that goes
// away is not held open by the list of another; the list becomes
// {list[keep], NULL}, for rdma_free_devices later. It returns -1 (and
// keeps every reference) when it cannot allocate.
static int mrfs_cm_keep(struct ibv_context **list, int keep)
{
	int n = 0, j = 0;
	while (list[n])
		n++;
	struct ibv_context **others = malloc(sizeof(*others) * n);
	if (!others)
		return -1;
	for (int i = 0; i < n; i++)
		if (i != keep)
			others[j++] = list[i];
	others[j] = NULL;
	rdma_free_devices(others); // frees others too
	list[0] = list[keep];
	list[1] = NULL;
	return 0;
}

static const char *mrfs_context_device(struct ibv_context *c)
{
	return ibv_get_device_name(c->device);
}

// mrfs_post posts one signaled work request: RDMA WRITE/READ with
// length bytes at laddr, or an atomic on 8 bytes at laddr.
static int mrfs_post(struct ibv_qp *qp, int opcode, uintptr_t laddr, uint32_t length, uint32_t lkey,
		     uint64_t raddr, uint32_t rkey, uint64_t compare_add, uint64_t swap, uint64_t wr_id)
{
	struct ibv_sge sge;
	struct ibv_send_wr wr, *bad;
	memset(&wr, 0, sizeof(wr));
	sge.addr = laddr;
	sge.length = length;
	sge.lkey = lkey;
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = length ? 1 : 0;
	wr.opcode = opcode;
	wr.send_flags = IBV_SEND_SIGNALED;
	if (opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
		wr.wr.atomic.remote_addr = raddr;
		wr.wr.atomic.rkey = rkey;
		wr.wr.atomic.compare_add = compare_add;
		wr.wr.atomic.swap = swap;
	} else {
		wr.wr.rdma.remote_addr = raddr;
		wr.wr.rdma.rkey = rkey;
	}
	return ibv_post_send(qp, &wr, &bad);
}

// mrfs_poll polls one completion: 1 with its status and wr_id, 0 when
// there is none, < 0 on error.
static int mrfs_poll(struct ibv_cq *cq, uint32_t *status, uint64_t *wr_id)
{
	struct ibv_wc wc;
	int n = ibv_poll_cq(cq, 1, &wc);
	if (n == 1) {
		*status = wc.status;
		*wr_id = wc.wr_id;
	}
	return n;
}
*/
import "C"

import (
	"syscall"
	"unsafe"
)

// Values from verbs.h that the pure-Go files need.
const (
	capMemWindow = uint32(C.IBV_DEVICE_MEM_WINDOW)
)

// cDevice is an ibv_device of a device list; valid until the list is
// freed, so a device must be opened before that.
type cDevice struct{ p *C.struct_ibv_device }

// getDevices wraps ibv_get_device_list. free releases the list (devices
// opened from it stay open).
func getDevices() (devs []cDevice, free func(), err error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, nil, errnoOf(err)
	}
	for _, p := range unsafe.Slice(list, int(n)) {
		devs = append(devs, cDevice{p})
	}
	return devs, func() { C.ibv_free_device_list(list) }, nil
}

// name wraps ibv_get_device_name.
func (d cDevice) name() string { return C.GoString(C.ibv_get_device_name(d.p)) }

// cContext is an open device.
type cContext struct{ p *C.struct_ibv_context }

// open wraps ibv_open_device.
func (d cDevice) open() (cContext, error) {
	p, err := C.ibv_open_device(d.p)
	if p == nil {
		return cContext{}, errnoOf(err)
	}
	return cContext{p}, nil
}

// close wraps ibv_close_device, which returns -1 with errno on failure.
func (c cContext) close() error {
	if r, err := C.ibv_close_device(c.p); r != 0 {
		return errnoOf(err)
	}
	return nil
}

// rawAttr is what ibv_query_device_ex reports that mrfs uses.
type rawAttr struct {
	maxMR, maxPD       int
	maxMRSize          uint64
	pageSizeCap        uint64
	capFlags, vendorID uint32
	odp                bool // odp_caps.general_caps has IBV_ODP_SUPPORT
}

// query wraps ibv_query_device_ex, which returns an errno value. It
// falls back to ibv_query_device by itself when the provider lacks the
// extended query; odp_caps is then zero.
func (c cContext) query() (rawAttr, error) {
	var a C.struct_ibv_device_attr_ex
	if r := C.ibv_query_device_ex(c.p, nil, &a); r != 0 {
		return rawAttr{}, syscall.Errno(r)
	}
	o := &a.orig_attr
	return rawAttr{
		maxMR:       int(o.max_mr),
		maxPD:       int(o.max_pd),
		maxMRSize:   uint64(o.max_mr_size),
		pageSizeCap: uint64(o.page_size_cap),
		capFlags:    uint32(o.device_cap_flags),
		vendorID:    uint32(o.vendor_id),
		odp:         uint64(a.odp_caps.general_caps)&uint64(C.IBV_ODP_SUPPORT) != 0,
	}, nil
}

// cPD is a protection domain.
type cPD struct{ p *C.struct_ibv_pd }

// allocPD wraps ibv_alloc_pd.
func (c cContext) allocPD() (cPD, error) {
	p, err := C.ibv_alloc_pd(c.p)
	if p == nil {
		return cPD{}, errnoOf(err)
	}
	return cPD{p}, nil
}

// handle is pd->handle, the kernel's number for the PD.
func (p cPD) handle() uint32 { return uint32(p.p.handle) }

// dealloc wraps ibv_dealloc_pd, which returns an errno value (not -1).
func (p cPD) dealloc() syscall.Errno { return syscall.Errno(C.ibv_dealloc_pd(p.p)) }

// cMR is a memory region.
type cMR struct{ p *C.struct_ibv_mr }

// mrFields are the ibv_mr fields mrfs reads.
type mrFields struct {
	lkey, rkey uint32
	addr       uintptr
	length     uint64
}

// regMR wraps ibv_reg_mr_iova2 (ibv_reg_mr is a macro).
func (p cPD) regMR(addr uintptr, length, iova uint64, access uint32) (cMR, error) {
	m, err := C.mrfs_reg_mr(p.p, C.uintptr_t(addr), C.size_t(length), C.uint64_t(iova), C.uint(access))
	if m == nil {
		return cMR{}, errnoOf(err)
	}
	return cMR{m}, nil
}

func (m cMR) fields() mrFields {
	return mrFields{
		lkey:   uint32(m.p.lkey),
		rkey:   uint32(m.p.rkey),
		addr:   uintptr(m.p.addr),
		length: uint64(m.p.length),
	}
}

// dereg wraps ibv_dereg_mr, which returns an errno value (not -1). On
// success the ibv_mr is freed.
func (m cMR) dereg() syscall.Errno { return syscall.Errno(C.ibv_dereg_mr(m.p)) }

// The librdmacm connection manager: an event channel, the ids on it, and
// the queue pair and completion queue of one connection.

// getCMContexts wraps rdma_get_devices: librdmacm's own open contexts,
// the ones its cm ids use. librdmacm counts references to them and
// closes the context of a device that went away once no reference is
// left; the caller never closes them: release gives the references back.
// rdma_get_devices also syncs librdmacm's list with the devices present.
func getCMContexts() (ctxs []cContext, release func(), err error) {
	var n C.int
	list, err := C.rdma_get_devices(&n)
	if list == nil {
		return nil, nil, errnoOf(err)
	}
	for _, p := range unsafe.Slice(list, int(n)) {
		ctxs = append(ctxs, cContext{p})
	}
	return ctxs, func() { C.rdma_free_devices(list) }, nil
}

// getCMContext is librdmacm's context of the named device, with a
// reference on it alone (release gives it back); ok is false when
// librdmacm has none.
func getCMContext(name string) (ctx cContext, release func(), ok bool) {
	var n C.int
	list, _ := C.rdma_get_devices(&n)
	if list == nil {
		return cContext{}, nil, false
	}
	all := unsafe.Slice(list, int(n))
	for i, p := range all {
		if (cContext{p}).deviceName() != name {
			continue
		}
		// A reference on every device would hold open any of them that
		// goes away (its removal waits for the context) as long as this
		// one is open.
		C.mrfs_cm_keep(list, C.int(i))
		return cContext{p}, func() {
			// Gone by now, the device's context closes here (its
			// removal waits for that) if librdmacm's last sync saw it
			// go, else at the next (Names).
			C.rdma_free_devices(list)
		}, true
	}
	C.rdma_free_devices(list)
	return cContext{}, nil, false
}

// deviceName is the name of the device the context is open on.
func (c cContext) deviceName() string { return C.GoString(C.mrfs_context_device(c.p)) }

// cChannel is an rdma_event_channel.
type cChannel struct{ p *C.struct_rdma_event_channel }

// createChannel wraps rdma_create_event_channel.
func createChannel() (cChannel, error) {
	p, err := C.rdma_create_event_channel()
	if p == nil {
		return cChannel{}, errnoOf(err)
	}
	return cChannel{p}, nil
}

func (ch cChannel) fd() int { return int(ch.p.fd) }

// destroy wraps rdma_destroy_event_channel (no result).
func (ch cChannel) destroy() { C.rdma_destroy_event_channel(ch.p) }

// cID is an rdma_cm_id.
type cID struct{ p *C.struct_rdma_cm_id }

// createID wraps rdma_create_id with RDMA_PS_TCP (reliable connected).
func (ch cChannel) createID() (cID, error) {
	var id *C.struct_rdma_cm_id
	if r, err := C.mrfs_create_id(ch.p, &id); r != 0 {
		return cID{}, errnoOf(err)
	}
	return cID{id}, nil
}

// rawEvent is a copied, already acknowledged rdma_cm_event.
type rawEvent struct {
	typ, status       int
	id, listenID      cID
	initDepth, respRs uint8
	private           []byte
}

// getEvent wraps rdma_get_cm_event and rdma_ack_cm_event. On a
// non-blocking channel it fails with EAGAIN when no event is queued.
func (ch cChannel) getEvent() (rawEvent, error) {
	var ev C.struct_mrfs_event
	if r, err := C.mrfs_get_event(ch.p, &ev); r != 0 {
		return rawEvent{}, errnoOf(err)
	}
	e := rawEvent{
		typ: int(ev._type), status: int(ev.status),
		id: cID{ev.id}, listenID: cID{ev.listen_id},
		initDepth: uint8(ev.initiator_depth), respRs: uint8(ev.responder_resources),
	}
	if ev.private_len > 0 {
		e.private = C.GoBytes(unsafe.Pointer(&ev.private_data[0]), ev.private_len)
	}
	return e, nil
}

// cmErr reads errno after a librdmacm call that returns -1 with errno.
func cmErr(r C.int, err error) error {
	if r == 0 {
		return nil
	}
	return errnoOf(err)
}

// bind wraps rdma_bind_addr; ip is 4 or 16 bytes.
func (id cID) bind(ip []byte, port uint16) error {
	r, err := C.mrfs_bind_addr(id.p, (*C.uint8_t)(unsafe.Pointer(&ip[0])), C.int(len(ip)), C.uint16_t(port))
	return cmErr(r, err)
}

// listen wraps rdma_listen.
func (id cID) listen(backlog int) error {
	r, err := C.rdma_listen(id.p, C.int(backlog))
	return cmErr(r, err)
}

// srcPort wraps rdma_get_src_port (network order in C).
func (id cID) srcPort() uint16 {
	p := uint16(C.rdma_get_src_port(id.p))
	return p>>8 | p<<8
}

// resolveAddr wraps rdma_resolve_addr with no source address.
func (id cID) resolveAddr(ip []byte, port uint16, timeoutMS int) error {
	r, err := C.mrfs_resolve_addr(id.p, (*C.uint8_t)(unsafe.Pointer(&ip[0])), C.int(len(ip)), C.uint16_t(port), C.int(timeoutMS))
	return cmErr(r, err)
}

// resolveRoute wraps rdma_resolve_route.
func (id cID) resolveRoute(timeoutMS int) error {
	r, err := C.rdma_resolve_route(id.p, C.int(timeoutMS))
	return cmErr(r, err)
}

// connect wraps rdma_connect; librdmacm copies the private data.
func (id cID) connect(private []byte, respRes, initDepth uint8) error {
	var p unsafe.Pointer
	if len(private) > 0 {
		p = unsafe.Pointer(&private[0])
	}
	r, err := C.mrfs_connect(id.p, p, C.uint8_t(len(private)), C.uint8_t(respRes), C.uint8_t(initDepth))
	return cmErr(r, err)
}

// accept wraps rdma_accept, which moves the id's QP to RTS first.
func (id cID) accept(respRes, initDepth uint8) error {
	r, err := C.mrfs_accept(id.p, C.uint8_t(respRes), C.uint8_t(initDepth))
	return cmErr(r, err)
}

// reject wraps rdma_reject; librdmacm copies the private data.
func (id cID) reject(private []byte) error {
	var p unsafe.Pointer
	if len(private) > 0 {
		p = unsafe.Pointer(&private[0])
	}
	r, err := C.rdma_reject(id.p, p, C.uint8_t(len(private)))
	return cmErr(r, err)
}

// disconnect wraps rdma_disconnect (moves the QP to ERROR, sends a DREQ).
func (id cID) disconnect() error {
	r, err := C.rdma_disconnect(id.p)
	return cmErr(r, err)
}

// destroy wraps rdma_destroy_id. It blocks until every event of the id
// that was reported has been acknowledged.
func (id cID) destroy() error {
	r, err := C.rdma_destroy_id(id.p)
	return cmErr(r, err)
}

// context is the device context the id is bound to (NULL before).
func (id cID) context() cContext { return cContext{id.p.verbs} }

// deviceName is the name of the id's device, "" before it is bound.
func (id cID) deviceName() string {
	n := C.mrfs_id_device(id.p)
	if n == nil {
		return ""
	}
	return C.GoString(n)
}

// cCQ is a completion queue.
type cCQ struct{ p *C.struct_ibv_cq }

// createCQ wraps ibv_create_cq (no channel: polled).
func (c cContext) createCQ(cqe int) (cCQ, error) {
	p, err := C.ibv_create_cq(c.p, C.int(cqe), nil, nil, 0)
	if p == nil {
		return cCQ{}, errnoOf(err)
	}
	return cCQ{p}, nil
}

// destroy wraps ibv_destroy_cq, which returns an errno value.
func (cq cCQ) destroy() syscall.Errno { return syscall.Errno(C.ibv_destroy_cq(cq.p)) }

// createQP wraps rdma_create_qp: an RC QP in pd on the id's context,
// with cq for both queues; it becomes id->qp.
func (id cID) createQP(pd cPD, cq cCQ, depth int) error {
	r, err := C.mrfs_create_qp(id.p, pd.p, cq.p, C.uint32_t(depth))
	return cmErr(r, err)
}

// destroyQP wraps rdma_destroy_qp (no result).
func (id cID) destroyQP() { C.rdma_destroy_qp(id.p) }

// qpNum is id->qp->qp_num, 0 without a QP.
func (id cID) qpNum() uint32 {
	if id.p.qp == nil {
		return 0
	}
	return uint32(id.p.qp.qp_num)
}

// The work request opcodes mrfs posts.
const (
	opWrite = int(C.IBV_WR_RDMA_WRITE)
	opRead  = int(C.IBV_WR_RDMA_READ)
	opCAS   = int(C.IBV_WR_ATOMIC_CMP_AND_SWP)
	opFAdd  = int(C.IBV_WR_ATOMIC_FETCH_AND_ADD)
)

// post wraps ibv_post_send of one signaled work request on id->qp;
// ibv_post_send returns an errno value.
func (id cID) post(op int, laddr uintptr, length, lkey uint32, raddr uint64, rkey uint32, compareAdd, swap, wrID uint64) syscall.Errno {
	return syscall.Errno(C.mrfs_post(id.p.qp, C.int(op), C.uintptr_t(laddr), C.uint32_t(length), C.uint32_t(lkey),
		C.uint64_t(raddr), C.uint32_t(rkey), C.uint64_t(compareAdd), C.uint64_t(swap), C.uint64_t(wrID)))
}

// poll wraps ibv_poll_cq for one completion: n is 1, 0 (none) or < 0.
func (cq cCQ) poll() (n int, status uint32, wrID uint64) {
	var st C.uint32_t
	var id C.uint64_t
	r := C.mrfs_poll(cq.p, &st, &id)
	return int(r), uint32(st), uint64(id)
}

// The rdma_cm event types mrfs handles.
const (
	evAddrResolved   = int(C.RDMA_CM_EVENT_ADDR_RESOLVED)
	evAddrError      = int(C.RDMA_CM_EVENT_ADDR_ERROR)
	evRouteResolved  = int(C.RDMA_CM_EVENT_ROUTE_RESOLVED)
	evRouteError     = int(C.RDMA_CM_EVENT_ROUTE_ERROR)
	evConnectRequest = int(C.RDMA_CM_EVENT_CONNECT_REQUEST)
	evConnectError   = int(C.RDMA_CM_EVENT_CONNECT_ERROR)
	evUnreachable    = int(C.RDMA_CM_EVENT_UNREACHABLE)
	evRejected       = int(C.RDMA_CM_EVENT_REJECTED)
	evEstablished    = int(C.RDMA_CM_EVENT_ESTABLISHED)
	evDisconnected   = int(C.RDMA_CM_EVENT_DISCONNECTED)
	evDeviceRemoval  = int(C.RDMA_CM_EVENT_DEVICE_REMOVAL)
	evTimewaitExit   = int(C.RDMA_CM_EVENT_TIMEWAIT_EXIT)
)

// eventName wraps rdma_event_str.
func eventName(t int) string { return C.GoString(C.rdma_event_str(C.enum_rdma_cm_event_type(t))) }

// peerAddr reads the id's peer address (rdma_get_peer_addr) as its
// bytes (4 or 16, none when unset) and port.
func (id cID) peerAddr() (ip []byte, port uint16) {
	sa := C.rdma_get_peer_addr(id.p)
	switch sa.sa_family {
	case C.AF_INET:
		s4 := (*C.struct_sockaddr_in)(unsafe.Pointer(sa))
		ip = C.GoBytes(unsafe.Pointer(&s4.sin_addr), 4)
		port = uint16(s4.sin_port)
	case C.AF_INET6:
		s6 := (*C.struct_sockaddr_in6)(unsafe.Pointer(sa))
		ip = C.GoBytes(unsafe.Pointer(&s6.sin6_addr), 16)
		port = uint16(s6.sin6_port)
	default:
		return nil, 0
	}
	return ip, port>>8 | port<<8 // network order
}

// cQP is a queue pair mrfs manages itself (not id->qp).
type cQP struct{ p *C.struct_ibv_qp }

// createOwnQP wraps ibv_create_qp for an RC QP.
func (p cPD) createOwnQP(cq cCQ, depth int) (cQP, error) {
	q, err := C.mrfs_create_own_qp(p.p, cq.p, C.uint32_t(depth))
	if q == nil {
		return cQP{}, errnoOf(err)
	}
	return cQP{q}, nil
}

func (q cQP) num() uint32 { return uint32(q.p.qp_num) }

// ready moves q to RTS for id with the given remote access flags.
func (q cQP) ready(id cID, access uint32, respRes uint8) error {
	r, err := C.mrfs_ready_qp(id.p, q.p, C.int(access), C.uint8_t(respRes))
	return cmErr(r, err)
}

// toError moves q to ERROR; ibv_modify_qp returns an errno value.
func (q cQP) toError() syscall.Errno { return syscall.Errno(C.mrfs_qp_error(q.p)) }

// destroy wraps ibv_destroy_qp, which returns an errno value.
func (q cQP) destroy() syscall.Errno { return syscall.Errno(C.ibv_destroy_qp(q.p)) }

// acceptQPN wraps rdma_accept for a QP librdmacm does not manage.
// acceptQPN wraps rdma_accept for a QP of mrfs's own; librdmacm copies
// the private data.
func (id cID) acceptQPN(qpn uint32, respRes uint8, private []byte) error {
	var p unsafe.Pointer
	if len(private) > 0 {
		p = unsafe.Pointer(&private[0])
	}
	r, err := C.mrfs_accept_qpn(id.p, C.uint32_t(qpn), C.uint8_t(respRes), p, C.uint8_t(len(private)))
	return cmErr(r, err)
}
