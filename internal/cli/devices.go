package cli

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"text/tabwriter"

	"mrfs/internal/config"
	"mrfs/mount"
)

// cmdDevices lists the devices of the backend the config chooses.
func cmdDevices(args []string, stdout io.Writer) error {
	f := flag.NewFlagSet("devices", flag.ContinueOnError)
	cfgPath := f.String("config", "", "config `FILE`")
	backend := f.String("backend", "", "verbs backend `auto|rdma|soft` (overrides the config)")
	if _, err := parse(f, args, 0); err != nil {
		return err
	}
	cfg, err := config.Load(*cfgPath)
	if err != nil {
		return err
	}
	if *backend != "" {
		cfg.Verbs.Backend = *backend
		if err := cfg.Validate(); err != nil {
			return err
		}
	}
	prov, err := mount.ChooseProvider(cfg.Verbs, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	devs, err := prov.Devices()
	if err != nil {
		return fmt.Errorf("list devices of backend %s: %w", prov.Name(), err)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DEVICE\tBACKEND\tMAX_MR\tMAX_MR_SIZE\tMAX_PD\tPAGE_SIZE_CAP\tACCESS")
	for _, d := range devs {
		a := d.Attr
		fmt.Fprintf(tw, "%s\t%s\t%d\t%#x\t%d\t%#x\t%s\n", d.Name, prov.Name(), a.MaxMR,
			a.MaxMRSize, a.MaxPD, a.PageSizeCap, a.Access)
	}
	return tw.Flush()
}
