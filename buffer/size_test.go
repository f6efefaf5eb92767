package buffer

import (
	"testing"
	"unsafe"
)

// A Buffer is made per file, up to millions of them: it stays in the
// 208-byte size class the memory per buffer was measured with
// (docs/BENCHMARKS.md, "Memory per buffer"). What few buffers need goes
// behind a pointer (slot, src).
func TestBufferSizeClass(t *testing.T) {
	if n := unsafe.Sizeof(Buffer{}); n > 208 {
		t.Errorf("Buffer is %d bytes, past the 208-byte size class: every buffer pays for it", n)
	}
}
