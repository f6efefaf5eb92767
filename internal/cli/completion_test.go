package cli

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// flagCase is one flag of one command, as typed: mrfs remote read --pd.
type flagCase struct {
	words []string // mrfs, the command, its operation if any
	flag  string   // -d, --daemon
}

// everyFlag lists every flag name of every command, from the commands'
// own definitions: a flag added anywhere is in this list.
func everyFlag(t *testing.T) []flagCase {
	var out []flagCase
	for _, c := range commands() {
		words := []string{"mrfs", c.name}
		if len(c.ops) > 0 {
			words = append(words, c.ops[0])
		}
		fs := flagsOf(c)
		listed := map[string]bool{}
		for _, o := range options(fs) {
			for _, n := range o.names {
				out = append(out, flagCase{words, dashed(n)})
				listed[n] = true
			}
		}
		if fs != nil {
			fs.VisitAll(func(f *flag.Flag) {
				if !listed[f.Name] {
					t.Errorf("mrfs %s: options() drops --%s", c.name, f.Name)
				}
			})
		}
	}
	if len(out) < 15 {
		t.Fatalf("only %d flags found: flagsOf does not see the commands' flags", len(out))
	}
	return out
}

func needShell(t *testing.T, name string) string {
	path, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("%s is not installed (scripts/test installs it)", name)
	}
	return path
}

func writeScript(t *testing.T, gen func(w *bytes.Buffer)) string {
	var b bytes.Buffer
	gen(&b)
	path := filepath.Join(t.TempDir(), "completion")
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// bashComplete runs the bash completion for each line of words (the last
// word is the one being completed) and returns the candidates of each.
func bashComplete(t *testing.T, script string, lines [][]string) [][]string {
	t.Helper()
	var prog strings.Builder
	fmt.Fprintf(&prog, "source %q\n", script)
	for _, words := range lines {
		var quoted []string
		for _, w := range words {
			quoted = append(quoted, fmt.Sprintf("%q", w))
		}
		fmt.Fprintf(&prog, "COMP_WORDS=(%s); COMP_CWORD=%d; COMPREPLY=(); _mrfs; echo \"${COMPREPLY[*]}\"\n",
			strings.Join(quoted, " "), len(words)-1)
	}
	out, err := exec.Command(needShell(t, "bash"), "-c", prog.String()).CombinedOutput()
	if err != nil {
		t.Fatalf("bash: %v\n%s", err, out)
	}
	var got [][]string
	for _, l := range strings.Split(strings.TrimSuffix(string(out), "\n"), "\n") {
		got = append(got, strings.Fields(l))
	}
	if len(got) != len(lines) {
		t.Fatalf("bash printed %d lines for %d completions:\n%s", len(got), len(lines), out)
	}
	return got
}

// Bash completes every flag of every command, the commands, the values
// of flags that list them, mount options, and mount points.
func TestBashCompletion(t *testing.T) {
	script := writeScript(t, func(b *bytes.Buffer) { bashCompletion(b) })
	flags := everyFlag(t)
	var lines [][]string
	for _, f := range flags {
		lines = append(lines, append(slices.Clone(f.words), f.flag))
	}
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "mnt"), 0o755); err != nil {
		t.Fatal(err)
	}
	extra := []struct {
		words []string
		want  []string
	}{
		{[]string{"mrfs", "um"}, []string{"umount"}},
		{[]string{"mrfs", "mount", "--backend", ""}, []string{"auto", "rdma", "soft"}},
		{[]string{"mrfs", "mount", "-o", "backend=soft,allow_o"}, []string{"backend=soft,allow_other"}},
		{[]string{"mrfs", "mount", "-o", "buffers.max_p"}, []string{"buffers.max_pinned=", "buffers.max_pinned_per_user="}},
		{[]string{"mrfs", "mount", filepath.Join(dir, "mn")}, []string{filepath.Join(dir, "mnt")}},
		{[]string{"mrfs", "remote", "c"}, []string{"cas"}},
		{[]string{"mrfs", "completion", "z"}, []string{"zsh"}},
	}
	for _, e := range extra {
		lines = append(lines, e.words)
	}
	got := bashComplete(t, script, lines)
	for i, f := range flags {
		if !slices.Contains(got[i], f.flag) {
			t.Errorf("bash: %q completes to %q, without %s", strings.Join(lines[i], " "), got[i], f.flag)
		}
	}
	for i, e := range extra {
		if g := got[len(flags)+i]; !slices.Equal(g, e.want) {
			t.Errorf("bash: %q completes to %q, want %q", strings.Join(e.words, " "), g, e.want)
		}
	}
}

// Fish completes every flag (its own completion engine runs the script).
func TestFishCompletion(t *testing.T) {
	fish := needShell(t, "fish")
	script := writeScript(t, func(b *bytes.Buffer) { fishCompletion(b) })
	seen := map[string]string{}
	for _, f := range everyFlag(t) {
		line := strings.Join(f.words, " ") + " -"
		if _, ok := seen[line]; !ok {
			out, err := exec.Command(fish, "-c", fmt.Sprintf("source %q; complete -C%q", script, line)).CombinedOutput()
			if err != nil {
				t.Fatalf("fish: %v\n%s", err, out)
			}
			seen[line] = string(out)
		}
		var cands []string
		for _, l := range strings.Split(seen[line], "\n") {
			cands = append(cands, strings.Split(l, "\t")[0])
		}
		if !slices.Contains(cands, f.flag) {
			t.Errorf("fish: %q completes to %q, without %s", line, cands, f.flag)
		}
	}
	out, _ := exec.Command(fish, "-c", fmt.Sprintf("source %q; complete -C'mrfs mount --backend '", script)).CombinedOutput()
	if !strings.Contains(string(out), "rdma\t") {
		t.Errorf("fish: --backend values: %q", out)
	}
}

// The zsh script is valid zsh and names every flag in a spec.
func TestZshCompletion(t *testing.T) {
	zsh := needShell(t, "zsh")
	script := writeScript(t, func(b *bytes.Buffer) { zshCompletion(b) })
	if out, err := exec.Command(zsh, "-n", script).CombinedOutput(); err != nil {
		t.Fatalf("zsh -n: %v\n%s", err, out)
	}
	b, _ := os.ReadFile(script)
	for _, f := range everyFlag(t) {
		// '--lazy[...]' alone, or {-d,--daemon} in a group.
		if !strings.Contains(string(b), "'"+f.flag+"[") && !strings.Contains(string(b), f.flag+",") && !strings.Contains(string(b), ","+f.flag+"}") {
			t.Errorf("zsh: %s %s has no spec", strings.Join(f.words, " "), f.flag)
		}
	}
}

// The manual and the usage name every flag, and the manual is clean roff.
func TestManAndUsageListEveryFlag(t *testing.T) {
	var man bytes.Buffer
	manPage(&man)
	u := usage()
	for _, f := range everyFlag(t) {
		if !strings.Contains(man.String(), `\fB`+roff(f.flag)+`\fR`) {
			t.Errorf("the manual lacks %s of %s", f.flag, strings.Join(f.words, " "))
		}
		if !strings.Contains(u, f.flag+" ") && !strings.Contains(u, f.flag+"|") && !strings.Contains(u, f.flag+"]") {
			t.Errorf("the usage lacks %s of %s", f.flag, strings.Join(f.words, " "))
		}
	}
	for _, c := range commands() {
		if !strings.Contains(man.String(), ".SS "+roff(c.name)) {
			t.Errorf("the manual has no section for %s", c.name)
		}
	}
	mandoc := needShell(t, "mandoc")
	cmd := exec.Command(mandoc, "-T", "lint", "-W", "style")
	cmd.Stdin = &man
	if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("mandoc -T lint: %v\n%s", err, out)
	}
}

// --help answers with the command's flags and runs nothing.
func TestCommandHelp(t *testing.T) {
	code, out, _ := runCLI("mount", "--help")
	if code != exitOK || !strings.Contains(out, "-d, --daemon") || !strings.Contains(out, "--backend auto|rdma|soft") {
		t.Errorf("mount --help: exit %d\n%s", code, out)
	}
	code, out, _ = runCLI("remote", "cas", "-h")
	if code != exitOK || !strings.Contains(out, "--swap") {
		t.Errorf("remote cas -h: exit %d\n%s", code, out)
	}
	code, out, _ = runCLI("completion", "bash")
	if code != exitOK || !strings.Contains(out, "complete -F _mrfs mrfs") {
		t.Errorf("completion bash: exit %d", code)
	}
	if code, _, stderr := runCLI("completion", "tcsh"); code != exitUsage || !strings.Contains(stderr, "tcsh") {
		t.Errorf("completion tcsh: exit %d, %q", code, stderr)
	}
}
