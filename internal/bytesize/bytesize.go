// Package bytesize writes byte counts for people, the one way every log
// line and error message of mrfs does: "4 KiB", "64 MiB", "1.5 GiB".
package bytesize

import (
	"strconv"
	"strings"
)

var units = []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}

// Format writes n in the largest binary unit it reaches: exactly when it
// is a whole number of that unit ("64 MiB"), else with one decimal
// ("1.5 MiB", "97.7 KiB"). When that decimal would read as whole
// ("1.0 MiB" for one byte less) it writes the exact bytes instead
// ("1048575 B"), so a message never hides a difference that matters.
func Format(n uint64) string {
	u, v := 0, n
	for v >= 1024 && v%1024 == 0 && u < len(units)-1 {
		v /= 1024
		u++
	}
	if v < 1024 {
		return strconv.FormatUint(v, 10) + " " + units[u]
	}
	f := float64(n)
	for u = 0; f >= 1024 && u < len(units)-1; u++ {
		f /= 1024
	}
	s := strconv.FormatFloat(f, 'f', 1, 64)
	if strings.HasSuffix(s, ".0") {
		return strconv.FormatUint(n, 10) + " B"
	}
	return s + " " + units[u]
}
