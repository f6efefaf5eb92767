package remote

import (
	"encoding/hex"
	"fmt"
	"strings"

	"mrfs/buffer"
)

// Token is a PD's token (user.mrfs.token): a peer presents it in its
// hello or connect request to get a queue pair in the PD.
type Token = [buffer.TokenSize]byte

// ParseToken reads a token as user.mrfs.token shows it: 32 hex digits.
func ParseToken(s string) (Token, error) {
	var t Token
	b, err := hex.DecodeString(strings.TrimSpace(s))
	if err != nil || len(b) != len(t) {
		// Never the value: a token mistyped by one digit is still a
		// secret.
		return t, fmt.Errorf("the token is not %d hex digits (user.mrfs.token of the directory)", 2*len(t))
	}
	copy(t[:], b)
	return t, nil
}
