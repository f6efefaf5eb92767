package tree

import "time"

// SetClock makes the tree's time stamps come from f until restore.
func SetClock(f func() time.Time) (restore func()) {
	old := now
	now = f
	return func() { now = old }
}
