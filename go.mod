module mrfs

go 1.26.8

require (
	github.com/BurntSushi/toml v1.6.0
	github.com/hanwen/go-fuse/v2 v2.12.1
	golang.org/x/sys v0.50.0
)
