//go:build rdma

package cli

import (
	"log/slog"

	"mrfs/buffer"
	"mrfs/internal/config"
	"mrfs/remote/rdmacm"
)

// Built with -tags rdma, a mount on the rdma backend serves [remote]
// over rdma_cm: peers get real queue pairs and the NIC checks them.
func init() {
	rdmaRemote = func(cfg config.Remote, resolve func(string) (*buffer.Domain, error), log *slog.Logger) (rdmaListener, error) {
		l, err := rdmacm.Listen(cfg.Listen, resolve, rdmacm.Options{
			MaxConns:  cfg.MaxConnections,
			AllowFrom: cfg.AllowFrom,
			Log:       log,
		})
		if err != nil {
			// Not a typed nil in the interface.
			return nil, err
		}
		return l, nil
	}
}
