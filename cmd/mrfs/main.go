// Command mrfs mounts RDMA-registered memory buffers as files.
package main

import (
	"os"

	"mrfs/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:])) }
