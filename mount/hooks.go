package mount

import (
	"errors"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"mrfs/buffer"
	"mrfs/internal/gcpace"
)

// pauseEnv names a test hook. Set to 1, the daemon stops between the
// buffers' teardown and the device's close: it logs "paused after
// teardown" and waits for another SIGINT or SIGTERM. Tests then look at
// what the kernel still holds for the live daemon; after the device's
// close, or the exit, the kernel would have released whatever mrfs left
// registered, and that would hide the leak.
const pauseEnv = "MRFS_TEST_PAUSE_AFTER_TEARDOWN"

// chunkDelayEnv is a test hook: a duration to pause after each chunk a big
// registration populates, so that tests can watch its progress and
// interrupt it. Logged at warn: it slows every big registration.
const chunkDelayEnv = "MRFS_TEST_CHUNK_DELAY"

// mapReserveEnv is a test hook: the mappings the daemon keeps for itself
// below vm.max_map_count, so that a test under emulation reaches the
// limit with a few thousand buffers rather than 64,000 (the sysctl is the
// machine's: tests never lower it). Logged at warn.
const mapReserveEnv = "MRFS_TEST_MAP_RESERVE"

func testMapReserve(log *slog.Logger) int {
	v := os.Getenv(mapReserveEnv)
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		log.Warn("ignoring a test hook that is not a positive count", "hook", mapReserveEnv, "value", v)
		return 0
	}
	log.Warn("test hook: the daemon keeps this many mappings below vm.max_map_count", "hook", mapReserveEnv, "reserve", n)
	return n
}

// softGoneEnv is a test hook: a file whose lines name soft devices that
// are gone (read at each look), so that tests make NICs leave and come
// back. Logged at warn.
const softGoneEnv = "MRFS_TEST_SOFT_GONE"

// softPresent is soft.Options.Present for softGoneEnv, nil without it.
func softPresent(log *slog.Logger) func(string) bool {
	file := os.Getenv(softGoneEnv)
	if file == "" {
		return nil
	}
	log.Warn("test hook: soft devices named in this file are gone", "hook", softGoneEnv, "file", file)
	return func(name string) bool {
		b, _ := os.ReadFile(file)
		return !slices.Contains(strings.Fields(string(b)), name)
	}
}

// gcHeadroomEnv is a test hook: the GC headroom in bytes, small enough
// for a test's few buffers to move GOGC. Logged at warn.
const gcHeadroomEnv = "MRFS_TEST_GC_HEADROOM"

func gcHeadroom(log *slog.Logger) uint64 {
	v := os.Getenv(gcHeadroomEnv)
	if v == "" {
		return gcpace.Headroom
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil || n == 0 {
		log.Warn("ignoring a test hook that is not a positive byte count", "hook", gcHeadroomEnv, "value", v)
		return gcpace.Headroom
	}
	log.Warn("test hook: the garbage collector's headroom", "hook", gcHeadroomEnv, "bytes", n)
	return n
}

// publishDelayEnv is a test hook: a duration each publication pass waits
// before it writes to etcd, so that a removal not waited for is seen.
// Logged at warn.
const publishDelayEnv = "MRFS_TEST_PUBLISH_DELAY"

// upgradeHoldEnv is a test hook: a duration an upgrade holds the
// requests before it hands the mount over, so that what comes meanwhile
// (lookups, the names the daemon drops) meets the held gate. Logged at
// warn.
const upgradeHoldEnv = "MRFS_TEST_UPGRADE_HOLD"

func upgradeHold(log *slog.Logger) time.Duration {
	return testDelay(log, upgradeHoldEnv, "an upgrade holds the requests a while before it hands over")
}

func chunkDelay(log *slog.Logger) time.Duration {
	return testDelay(log, chunkDelayEnv, "big registrations pause after each chunk")
}

// testDelay is the duration the test hook env sets, said at warn.
func testDelay(log *slog.Logger, env, what string) time.Duration {
	v := os.Getenv(env)
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		log.Warn("ignoring a test hook that is not a duration", "hook", env, "value", v)
		return 0
	}
	log.Warn("test hook: "+what, "hook", env, "delay", d)
	return d
}

func pauseAfterTeardown(sigs <-chan os.Signal, freed buffer.Freed, log *slog.Logger) {
	if os.Getenv(pauseEnv) != "1" {
		return
	}
	log.Info("paused after teardown; send SIGINT or SIGTERM to go on", append([]any{"hook", pauseEnv}, freedAttrs(freed)...)...)
	<-sigs
}

// adoptFailEnv is a test hook: set to 1 in a program an upgrade executes,
// it fails once it has adopted the store and restored the namespace,
// before serving the connection, as an adoption the kernel refused would
// (the program before then takes the mount back: FallBack). It is taken
// out of the environment, so that program does not fail too. Set to a
// file's path (a keeper's children all have it), the daemon that finds
// the file removes it and fails: once.
const adoptFailEnv = "MRFS_TEST_ADOPT_FAIL"

func testAdoptFail(log *slog.Logger) error {
	v := os.Getenv(adoptFailEnv)
	os.Unsetenv(adoptFailEnv)
	if v != "1" && (!strings.HasPrefix(v, "/") || os.Remove(v) != nil) {
		return nil
	}
	log.Warn("test hook: this program fails to adopt the mount", "hook", adoptFailEnv)
	return errors.New("test hook " + adoptFailEnv + ": the adoption fails")
}

// dieAtDoneEnv is a test hook: a file whose existence makes the daemon
// under a keeper die (SIGKILL, removing the file first) right after it
// applied a request that changed the namespace (the change journaled
// with the request), before the reply: the kernel then sends the request
// again to the next daemon.
const dieAtDoneEnv = "MRFS_TEST_DIE_AT_DONE"

func testDieAtDone(log *slog.Logger) string {
	v := os.Getenv(dieAtDoneEnv)
	if v != "" {
		log.Warn("test hook: the daemon dies after a change once this file exists", "hook", dieAtDoneEnv, "file", v)
	}
	return v
}

// holdReplyEnv is a test hook: a file whose existence makes the daemon
// hold back for good (removing the file first) the reply of the next
// request that changes the namespace, once applied, as if the thread
// writing it were slow: an upgrade then executes its successor before
// the reply is written, and the kernel sends the request again.
const holdReplyEnv = "MRFS_TEST_HOLD_REPLY"

func testHoldReply(log *slog.Logger) func(unique uint64) bool {
	file := os.Getenv(holdReplyEnv)
	if file == "" {
		return nil
	}
	log.Warn("test hook: the reply of the next change is held back once this file exists", "hook", holdReplyEnv, "file", file)
	return func(unique uint64) bool { return os.Remove(file) == nil }
}

// lookupHoldEnv is a test hook: while the file it names exists, a lookup
// of the name "hold" waits (a minute at most) before it is answered,
// holding its directory's lock in the kernel, as a slow one would.
const lookupHoldEnv = "MRFS_TEST_LOOKUP_HOLD"

func testLookupHold(log *slog.Logger) func(name string) {
	file := os.Getenv(lookupHoldEnv)
	if file == "" {
		return nil
	}
	log.Warn("test hook: a lookup of hold waits while this file exists", "hook", lookupHoldEnv, "file", file)
	return func(name string) {
		for end := time.Now().Add(time.Minute); name == "hold" && time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			if _, err := os.Stat(file); err != nil {
				return
			}
		}
	}
}
