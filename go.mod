module mrfs

go 1.26.8

require (
	github.com/BurntSushi/toml v1.6.0 // indirect
	github.com/hanwen/go-fuse/v2 v2.12.1 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
