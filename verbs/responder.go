package verbs

import "fmt"

// WCStatus is a work completion status (enum ibv_wc_status), as the
// requester of a one-sided operation sees it.
type WCStatus uint32

// The statuses a requester of a one-sided operation can see.
const (
	WCSuccess      WCStatus = 0
	WCLocLenErr    WCStatus = 1
	WCLocProtErr   WCStatus = 4
	WCWRFlushErr   WCStatus = 5
	WCRemInvReqErr WCStatus = 9
	WCRemAccessErr WCStatus = 10
	WCRemOpErr     WCStatus = 11
)

var wcNames = map[WCStatus]string{
	WCSuccess:      "IBV_WC_SUCCESS",
	WCLocLenErr:    "IBV_WC_LOC_LEN_ERR",
	WCLocProtErr:   "IBV_WC_LOC_PROT_ERR",
	WCWRFlushErr:   "IBV_WC_WR_FLUSH_ERR",
	WCRemInvReqErr: "IBV_WC_REM_INV_REQ_ERR",
	WCRemAccessErr: "IBV_WC_REM_ACCESS_ERR",
	WCRemOpErr:     "IBV_WC_REM_OP_ERR",
}

// String is the libibverbs name, e.g. IBV_WC_REM_ACCESS_ERR.
func (s WCStatus) String() string {
	if n, ok := wcNames[s]; ok {
		return n
	}
	return fmt.Sprintf("IBV_WC_STATUS(%d)", uint32(s))
}

// Responder is the responder side of an RC queue pair in one PD: it runs
// one-sided operations against that PD's regions, checked in the order a
// NIC checks them (verbs-semantics.md §5: zero-length skip, then rkey, PD,
// access and state, then the range in iova space, then 8-byte alignment
// for atomics). A real NIC does this in hardware; the soft backend does it
// in Go so that its TCP transport can serve peers. The error state an RC
// QP enters after a failure is the transport's to keep.
type Responder interface {
	Read(dst []byte, iova uint64, rkey uint32) WCStatus
	Write(iova uint64, rkey uint32, src []byte) WCStatus
	CompareSwap(iova uint64, rkey uint32, compare, swap uint64) (old uint64, st WCStatus)
	FetchAdd(iova uint64, rkey uint32, add uint64) (old uint64, st WCStatus)
}

// ResponderPD is a PD whose backend can serve one-sided operations in
// software (the soft backend).
type ResponderPD interface {
	PD
	Responder() Responder
}
