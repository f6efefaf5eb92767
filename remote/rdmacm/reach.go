package rdmacm

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// deviceAddrs is, for each RDMA device under sys, the address a peer
// reaches it at: one of the addresses of the network device its port 1
// runs over (RoCE, iWARP: the port's first GID names it), IPv4 before
// IPv6, never a link-local one. A device without one (InfiniBand without
// IPoIB, a netdev with no address) is left out. addrsOf lists a network
// device's addresses.
func deviceAddrs(sys string, addrsOf func(netdev string) []netip.Addr) map[string]netip.Addr {
	out := map[string]netip.Addr{}
	devs, _ := os.ReadDir(sys)
	for _, d := range devs {
		b, err := os.ReadFile(filepath.Join(sys, d.Name(), "ports", "1", "gid_attrs", "ndevs", "0"))
		if err != nil {
			continue
		}
		var best netip.Addr
		for _, a := range addrsOf(strings.TrimSpace(string(b))) {
			if a.IsLinkLocalUnicast() || a.IsLoopback() || a.IsUnspecified() {
				continue
			}
			if !best.IsValid() || (a.Is4() && !best.Is4()) {
				best = a
			}
		}
		if best.IsValid() {
			out[d.Name()] = best
		}
	}
	return out
}

// reach is where peers reach the devices a listener bound to bound
// (with the port it got) serves: the one device of its address, or with
// the unspecified address, every device that has an address.
func reach(bound netip.AddrPort, device string, addrs func() map[string]netip.Addr) map[string]netip.AddrPort {
	out := map[string]netip.AddrPort{}
	if !bound.Addr().IsUnspecified() {
		if device != "" {
			out[device] = bound
		}
		return out
	}
	for dev, a := range addrs() {
		out[dev] = netip.AddrPortFrom(a, bound.Port())
	}
	return out
}
