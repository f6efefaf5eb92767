// Package tests holds mrfs's mounted end-to-end tests. They build the mrfs
// binary, run `mrfs mount` as a subprocess on a temporary mountpoint per test,
// and check the contract of shared DESIGN.md through the filesystem only:
// shell tools, xattrs, a C client and a Python client; system_test.go
// starts mrfs as a system does: --daemon, mount.fuse3, mount(8) and fstab
// (in a mount namespace), and as a systemd notify service. They need root and
// /dev/fuse; run them with `go test -race -count=1 ./tests/`.
package tests
