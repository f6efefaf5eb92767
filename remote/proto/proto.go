// Package proto is the wire format of mrfs's soft remote transport
// (docs/PROTOCOL.md): a versioned hello naming the PD directory, the
// one-sided operations READ, WRITE, COMPARE_AND_SWAP and FETCH_AND_ADD, and
// their completions. It only encodes and decodes; it never touches memory
// or sockets beyond the reader it is given.
//
// Decoding is strict because the peer is not trusted: every length is
// checked against the frame type and the negotiated maximum message size
// before anything is allocated, reserved fields must be zero, and a frame
// that breaks a rule is an error (the server then ends that connection).
package proto

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Version is the protocol version this package speaks: 2 added the
// PD's token to HELLO.
const Version = 2

// Magic opens every HELLO body, so that a stray client (an HTTP probe, a
// port scanner) is told apart from an mrfs peer at once.
const Magic = "MRFS"

// Type is a frame's type, the first byte of its header.
type Type uint8

// The frame types. Requests and the hello go from the peer to mrfs;
// HelloOK, HelloErr and Completion come back.
const (
	TypeHello      Type = 0x01
	TypeHelloOK    Type = 0x02
	TypeHelloErr   Type = 0x03
	TypeRead       Type = 0x10
	TypeWrite      Type = 0x11
	TypeCAS        Type = 0x12
	TypeFetchAdd   Type = 0x13
	TypeCompletion Type = 0x20
)

var typeNames = map[Type]string{
	TypeHello: "HELLO", TypeHelloOK: "HELLO_OK", TypeHelloErr: "HELLO_ERR",
	TypeRead: "READ", TypeWrite: "WRITE", TypeCAS: "COMPARE_AND_SWAP",
	TypeFetchAdd: "FETCH_AND_ADD", TypeCompletion: "COMPLETION",
}

func (t Type) String() string {
	if n, ok := typeNames[t]; ok {
		return n
	}
	return fmt.Sprintf("TYPE(0x%02x)", uint8(t))
}

// IsOp reports whether t is a one-sided operation.
func (t Type) IsOp() bool { return t >= TypeRead && t <= TypeFetchAdd }

// Sizes and limits of the format.
const (
	HeaderSize = 16
	// TokenSize is a PD token's size: 128 bits.
	TokenSize = 16
	// MaxPath bounds the directory a HELLO names (PATH_MAX).
	MaxPath = 4096
	// MaxErrMsg bounds the text of a HELLO_ERR.
	MaxErrMsg = 1024
	// MaxMessageLimit is the largest maximum message size a server may
	// announce: InfiniBand's 2 GiB.
	MaxMessageLimit = 1 << 31

	helloFixed     = 24 // magic, version, path length, token
	helloVersioned = 6  // magic, version: what every version's HELLO starts with
	helloOKSize    = 12 // version, reserved, pd, max message
	opFixed        = 16 // iova, rkey, length or reserved
	casSize        = 32
	faddSize       = 24
	complFixed     = 8 // status, opcode, reserved
)

// Frame is one decoded frame. Only the fields of its Type are used; the
// others are zero.
type Frame struct {
	Type Type
	// WRID is the requester's work request id, echoed in the completion.
	WRID uint64

	// HELLO: Version, Path, Token. HELLO_OK: Version, PD, MaxMessage.
	// HELLO_ERR: Errno, Msg. A HELLO of another version decodes to its
	// Version alone, for the server to refuse.
	Version    uint16
	Path       string
	Token      [TokenSize]byte // the PD's (user.mrfs.token)
	PD         uint32
	MaxMessage uint32
	Errno      uint32
	Msg        string

	// Operations. READ uses Length; WRITE carries Data; COMPARE_AND_SWAP
	// uses Compare and Swap; FETCH_AND_ADD uses Add.
	IOVA    uint64
	RKey    uint32
	Length  uint32
	Compare uint64
	Swap    uint64
	Add     uint64

	// COMPLETION: Status (an ibv_wc_status), Op (the request's type),
	// Data (a successful READ) or Old (a successful atomic).
	Status uint32
	Op     Type
	Old    uint64

	Data []byte // WRITE payload or READ result; may alias a reader's buffer
}

// ErrProtocol matches every decoding error (errors.Is): the peer broke the
// format, and the connection cannot be trusted to stay in step.
var ErrProtocol = errors.New("protocol violation")

// VersionError is a HELLO of a version this package does not speak: a
// protocol violation (errors.Is ErrProtocol) that the server answers
// with HELLO_ERR EPROTONOSUPPORT, since the peer may be an older mrfs.
type VersionError struct{ Version uint16 }

func (e *VersionError) Error() string {
	return fmt.Sprintf("%v: HELLO of version %d; this mrfs speaks %d", ErrProtocol, e.Version, Version)
}

func (e *VersionError) Is(target error) bool { return target == ErrProtocol }

// ErrShort is returned by Decode when b holds only part of a frame.
var ErrShort = errors.New("incomplete frame")

func violation(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// header is the fixed 16-byte start of every frame: type, flags (0),
// reserved (0), body length, wr_id; big-endian.
type header struct {
	typ  Type
	blen uint32
	wrid uint64
}

func parseHeader(b []byte) (header, error) {
	h := header{typ: Type(b[0]), blen: binary.BigEndian.Uint32(b[4:]), wrid: binary.BigEndian.Uint64(b[8:])}
	if b[1] != 0 || b[2] != 0 || b[3] != 0 {
		return h, violation("%s header has non-zero flags or reserved bytes", h.typ)
	}
	return h, nil
}

// bodyLimit checks a header's body length against its type before any
// byte of the body is read or allocated. maxMsg is the negotiated maximum
// message size; frames that carry data may hold that much plus their
// fixed part, no more.
func bodyLimit(h header, maxMsg uint32) error {
	n := h.blen
	exact := func(want uint32) error {
		if n != want {
			return violation("%s body is %d bytes, want %d", h.typ, n, want)
		}
		return nil
	}
	switch h.typ {
	case TypeHello:
		// Any version's magic and version, so that a peer of another
		// version is told so; this version's length is checked with them.
		if n < helloVersioned || n > helloFixed+MaxPath {
			return violation("HELLO body is %d bytes, want %d to %d", n, helloFixed, helloFixed+MaxPath)
		}
	case TypeHelloOK:
		return exact(helloOKSize)
	case TypeHelloErr:
		if n < 4 || n > 4+MaxErrMsg {
			return violation("HELLO_ERR body is %d bytes, want 4 to %d", n, 4+MaxErrMsg)
		}
	case TypeRead:
		return exact(opFixed)
	case TypeWrite:
		if n < opFixed || uint64(n) > opFixed+uint64(maxMsg) {
			return violation("WRITE body is %d bytes, want %d to %d (max message size %d)", n, opFixed, opFixed+uint64(maxMsg), maxMsg)
		}
	case TypeCAS:
		return exact(casSize)
	case TypeFetchAdd:
		return exact(faddSize)
	case TypeCompletion:
		if n < complFixed || uint64(n) > complFixed+uint64(maxMsg) {
			return violation("COMPLETION body is %d bytes, want %d to %d (max message size %d)", n, complFixed, complFixed+uint64(maxMsg), maxMsg)
		}
	default:
		return violation("unknown frame type 0x%02x", uint8(h.typ))
	}
	return nil
}

// parseBody fills a Frame from a body whose length bodyLimit accepted.
// Data aliases body.
func parseBody(h header, body []byte) (Frame, error) {
	be := binary.BigEndian
	f := Frame{Type: h.typ, WRID: h.wrid}
	zero32 := func(off int) error {
		if be.Uint32(body[off:]) != 0 {
			return violation("%s reserved field is not zero", h.typ)
		}
		return nil
	}
	switch h.typ {
	case TypeHello:
		if string(body[:4]) != Magic {
			return f, violation("HELLO does not start with %q", Magic)
		}
		f.Version = be.Uint16(body[4:])
		if f.Version != Version {
			return f, &VersionError{f.Version} // another layout
		}
		if len(body) < helloFixed {
			return f, violation("HELLO body is %d bytes, want at least %d", len(body), helloFixed)
		}
		plen := int(be.Uint16(body[6:]))
		if plen != len(body)-helloFixed {
			return f, violation("HELLO path length %d does not match its body (%d bytes of path)", plen, len(body)-helloFixed)
		}
		copy(f.Token[:], body[8:helloFixed])
		f.Path = string(body[helloFixed:])
	case TypeHelloOK:
		f.Version = be.Uint16(body)
		if be.Uint16(body[2:]) != 0 {
			return f, violation("HELLO_OK reserved field is not zero")
		}
		f.PD = be.Uint32(body[4:])
		f.MaxMessage = be.Uint32(body[8:])
		if f.MaxMessage == 0 || f.MaxMessage > MaxMessageLimit {
			return f, violation("HELLO_OK max message size %d is out of range (1 to %d)", f.MaxMessage, uint32(MaxMessageLimit))
		}
	case TypeHelloErr:
		f.Errno = be.Uint32(body)
		f.Msg = string(body[4:])
	case TypeRead:
		f.IOVA, f.RKey, f.Length = be.Uint64(body), be.Uint32(body[8:]), be.Uint32(body[12:])
	case TypeWrite:
		f.IOVA, f.RKey = be.Uint64(body), be.Uint32(body[8:])
		if err := zero32(12); err != nil {
			return f, err
		}
		f.Data = body[opFixed:]
	case TypeCAS, TypeFetchAdd:
		f.IOVA, f.RKey = be.Uint64(body), be.Uint32(body[8:])
		if err := zero32(12); err != nil {
			return f, err
		}
		if h.typ == TypeCAS {
			f.Compare, f.Swap = be.Uint64(body[16:]), be.Uint64(body[24:])
		} else {
			f.Add = be.Uint64(body[16:])
		}
	case TypeCompletion:
		f.Status = be.Uint32(body)
		f.Op = Type(body[4])
		if body[5] != 0 || body[6] != 0 || body[7] != 0 {
			return f, violation("COMPLETION reserved bytes are not zero")
		}
		rest := body[complFixed:]
		if !f.Op.IsOp() {
			return f, violation("COMPLETION of %s, which is not an operation", f.Op)
		}
		switch {
		case f.Status != 0 && len(rest) != 0:
			return f, violation("failed COMPLETION carries %d bytes", len(rest))
		case f.Status != 0:
		case f.Op == TypeRead:
			f.Data = rest
		case f.Op == TypeCAS || f.Op == TypeFetchAdd:
			if len(rest) != 8 {
				return f, violation("atomic COMPLETION carries %d bytes, want 8", len(rest))
			}
			f.Old = be.Uint64(rest)
		case len(rest) != 0:
			return f, violation("%s COMPLETION carries %d bytes, want 0", f.Op, len(rest))
		}
	}
	return f, nil
}

// Decode decodes the frame at the start of b and returns it with the
// number of bytes it took. ErrShort: b holds only part of a frame (the
// header is checked first, so an oversized length fails at once rather
// than waiting for bytes). Data aliases b.
func Decode(b []byte, maxMsg uint32) (Frame, int, error) {
	if len(b) < HeaderSize {
		return Frame{}, 0, ErrShort
	}
	h, err := parseHeader(b)
	if err != nil {
		return Frame{}, 0, err
	}
	if err := bodyLimit(h, maxMsg); err != nil {
		return Frame{}, 0, err
	}
	end := HeaderSize + int(h.blen)
	if len(b) < end {
		return Frame{}, 0, ErrShort
	}
	f, err := parseBody(h, b[HeaderSize:end])
	if err != nil {
		return Frame{}, 0, err
	}
	return f, end, nil
}

// MaxHelloFrame is the largest legal HELLO, header included: all a server
// reads of a peer before the peer's token is checked.
const MaxHelloFrame = HeaderSize + helloFixed + MaxPath

// ReadHello reads a connection's first frame, which must be a HELLO. A
// header of another type, or of a body longer than the largest HELLO's, is
// a protocol violation before any byte of the body is read, so a peer
// makes its reader read or allocate at most MaxHelloFrame bytes. It reads
// the frame and not a byte past it: frames the peer sent right behind its
// hello stay in r for the reader of the connection. io.EOF: r ended
// before the first byte; io.ErrUnexpectedEOF: inside the frame.
func ReadHello(r io.Reader) (Frame, error) {
	var hdr [HeaderSize]byte
	if n, err := io.ReadFull(r, hdr[:]); err != nil {
		if n > 0 {
			err = unexpected(err)
		}
		return Frame{}, err
	}
	h, err := parseHeader(hdr[:])
	if err != nil {
		return Frame{}, err
	}
	if h.typ != TypeHello {
		return Frame{}, violation("first frame is %s, want HELLO", h.typ)
	}
	if err := bodyLimit(h, 0); err != nil {
		return Frame{}, err
	}
	body := make([]byte, h.blen)
	if _, err := io.ReadFull(r, body); err != nil {
		return Frame{}, unexpected(err)
	}
	return parseBody(h, body)
}

// FrameSize is the size, header included, of the frame whose header b
// holds (at least HeaderSize bytes), as its body length announces it.
func FrameSize(b []byte) int64 {
	return HeaderSize + int64(binary.BigEndian.Uint32(b[4:]))
}

// Reader reads frames from a stream, reusing one body buffer. The buffer
// grows only after a header has passed bodyLimit, so a hostile length
// costs nothing.
type Reader struct {
	r      io.Reader
	maxMsg uint32
	hdr    [HeaderSize]byte
	buf    []byte
}

// NewReader reads frames from r with maximum message size maxMsg.
func NewReader(r io.Reader, maxMsg uint32) *Reader { return &Reader{r: r, maxMsg: maxMsg} }

// SetMaxMessage changes the limit, e.g. after a client learns the
// server's from HELLO_OK.
func (r *Reader) SetMaxMessage(n uint32) { r.maxMsg = n }

// Next reads one frame. Its Data is valid until the next call. io.EOF:
// the stream ended cleanly between frames; io.ErrUnexpectedEOF: inside
// one. Wraps ErrProtocol when the peer broke the format.
func (r *Reader) Next() (Frame, error) {
	return r.next(nil)
}

// NextStarted is Next with a hook run after the first byte of the frame
// has arrived: the server uses it to switch from its idle deadline to the
// deadline a started frame must meet.
func (r *Reader) NextStarted(started func()) (Frame, error) {
	return r.next(started)
}

// Scratch returns n bytes of the Reader's body buffer, grown if needed:
// valid until the next frame is read, which reuses it. A responder that
// answers each frame before reading the next can build its reply there
// and hold one buffer per connection.
func (r *Reader) Scratch(n int) []byte {
	if cap(r.buf) < n {
		r.buf = make([]byte, n)
	}
	return r.buf[:n]
}

func (r *Reader) next(started func()) (Frame, error) {
	if _, err := io.ReadFull(r.r, r.hdr[:1]); err != nil {
		return Frame{}, err
	}
	if started != nil {
		started()
	}
	if _, err := io.ReadFull(r.r, r.hdr[1:]); err != nil {
		return Frame{}, unexpected(err)
	}
	h, err := parseHeader(r.hdr[:])
	if err != nil {
		return Frame{}, err
	}
	if err := bodyLimit(h, r.maxMsg); err != nil {
		return Frame{}, err
	}
	if cap(r.buf) < int(h.blen) {
		r.buf = make([]byte, h.blen)
	}
	body := r.buf[:h.blen]
	if _, err := io.ReadFull(r.r, body); err != nil {
		return Frame{}, unexpected(err)
	}
	return parseBody(h, body)
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// Append encodes f after dst. It refuses what no decoder would accept
// from it: a path or message too long, data past MaxMessageLimit, a
// completion whose payload does not fit its status and opcode.
func Append(dst []byte, f Frame) ([]byte, error) {
	return appendFrame(dst, f, true)
}

// AppendPrefix is Append without the bytes of f.Data (a WRITE's payload,
// a READ completion's result), though the length in the header counts
// them: the caller sends f.Data right after, e.g. with net.Buffers, and
// saves copying a large message.
func AppendPrefix(dst []byte, f Frame) ([]byte, error) {
	return appendFrame(dst, f, false)
}

func appendFrame(dst []byte, f Frame, withData bool) ([]byte, error) {
	be := binary.BigEndian
	var extra int // data counted in the length but left to the caller
	var body []byte
	start := len(dst)
	dst = append(dst, byte(f.Type), 0, 0, 0, 0, 0, 0, 0)
	dst = be.AppendUint64(dst, f.WRID)
	switch f.Type {
	case TypeHello:
		if len(f.Path) > MaxPath {
			return dst[:start], fmt.Errorf("encode HELLO: path is %d bytes, the limit is %d", len(f.Path), MaxPath)
		}
		body = append([]byte(Magic), 0, 0, 0, 0)
		be.PutUint16(body[4:], f.Version)
		be.PutUint16(body[6:], uint16(len(f.Path)))
		dst = append(append(append(dst, body...), f.Token[:]...), f.Path...)
	case TypeHelloOK:
		if f.MaxMessage == 0 || f.MaxMessage > MaxMessageLimit {
			return dst[:start], fmt.Errorf("encode HELLO_OK: max message size %d is out of range", f.MaxMessage)
		}
		dst = be.AppendUint16(dst, f.Version)
		dst = be.AppendUint16(dst, 0)
		dst = be.AppendUint32(dst, f.PD)
		dst = be.AppendUint32(dst, f.MaxMessage)
	case TypeHelloErr:
		msg := f.Msg
		if len(msg) > MaxErrMsg {
			msg = msg[:MaxErrMsg] // a message is for people; cut it rather than fail
		}
		dst = be.AppendUint32(dst, f.Errno)
		dst = append(dst, msg...)
	case TypeRead:
		dst = be.AppendUint64(dst, f.IOVA)
		dst = be.AppendUint32(dst, f.RKey)
		dst = be.AppendUint32(dst, f.Length)
	case TypeWrite, TypeCAS, TypeFetchAdd:
		if len(f.Data) > MaxMessageLimit {
			return dst[:start], fmt.Errorf("encode WRITE: %d bytes is past the %d limit", len(f.Data), MaxMessageLimit)
		}
		dst = be.AppendUint64(dst, f.IOVA)
		dst = be.AppendUint32(dst, f.RKey)
		dst = be.AppendUint32(dst, 0)
		switch f.Type {
		case TypeWrite:
			if withData {
				dst = append(dst, f.Data...)
			} else {
				extra = len(f.Data)
			}
		case TypeCAS:
			dst = be.AppendUint64(dst, f.Compare)
			dst = be.AppendUint64(dst, f.Swap)
		default:
			dst = be.AppendUint64(dst, f.Add)
		}
	case TypeCompletion:
		if !f.Op.IsOp() {
			return dst[:start], fmt.Errorf("encode COMPLETION: %s is not an operation", f.Op)
		}
		dst = be.AppendUint32(dst, f.Status)
		dst = append(dst, byte(f.Op), 0, 0, 0)
		switch {
		case f.Status != 0:
		case f.Op == TypeRead:
			if len(f.Data) > MaxMessageLimit {
				return dst[:start], fmt.Errorf("encode COMPLETION: %d bytes is past the %d limit", len(f.Data), MaxMessageLimit)
			}
			if withData {
				dst = append(dst, f.Data...)
			} else {
				extra = len(f.Data)
			}
		case f.Op == TypeCAS || f.Op == TypeFetchAdd:
			dst = be.AppendUint64(dst, f.Old)
		}
	default:
		return dst[:start], fmt.Errorf("encode: unknown frame type %s", f.Type)
	}
	be.PutUint32(dst[start+4:], uint32(len(dst)-start-HeaderSize+extra))
	return dst, nil
}
