package cli

import (
	"flag"
	"fmt"
	"io"
	"strings"

	"mrfs/internal/config"
)

// cmdCompletion prints a shell's completion script, made from the
// commands' flag definitions (commands and flagsOf).
func cmdCompletion(args []string, stdout, _ io.Writer) error {
	f := flag.NewFlagSet("completion", flag.ContinueOnError)
	pos, err := parse(f, args, 1)
	if err != nil {
		return err
	}
	gen := map[string]func(io.Writer){"bash": bashCompletion, "zsh": zshCompletion, "fish": fishCompletion}[pos[0]]
	if gen == nil {
		return usageError("completion: unknown shell %q; want bash, zsh or fish", pos[0])
	}
	gen(stdout)
	return nil
}

// compCommand is what a completion script needs of one command.
type compCommand struct {
	command
	opts []option
}

func compCommands() []compCommand {
	var out []compCommand
	for _, c := range commands() {
		out = append(out, compCommand{c, options(flagsOf(c))})
	}
	return out
}

// names gives the command's name and aliases that are words (not -h).
func (c compCommand) names() []string {
	names := []string{c.name}
	for _, a := range c.aliases {
		if !strings.HasPrefix(a, "-") {
			names = append(names, a)
		}
	}
	return names
}

// positional says what the positional argument is: "dir" for a mount
// point, or a list of words (bash|zsh|fish); "" for nothing to offer.
func (c compCommand) positional() (dir bool, words []string) {
	switch {
	case strings.Contains(c.args, "MOUNTPOINT"):
		return true, nil
	case strings.Contains(c.args, "|"):
		return false, strings.Split(c.args, "|")
	}
	return false, nil
}

// valueKind says how to complete an option's value.
func valueKind(o option) string {
	switch {
	case len(o.choices) > 0:
		return "choices"
	case o.value == "FILE":
		return "file"
	case o.value == "OPTIONS":
		return "mountopts"
	}
	return "" // free text: nothing to offer
}

// mountOptionWords are the -o options as completion offers them: a
// valued one with its "=".
func mountOptionWords() []string {
	var words []string
	add := func(name, key string) {
		if config.IsBool(key) {
			words = append(words, name)
		} else {
			words = append(words, name+"=")
		}
	}
	for _, a := range mountAliases {
		add(a.name, a.key)
	}
	for _, k := range config.Keys() {
		add(k, k)
	}
	return append(words, noEffectNames()...)
}

func bashCompletion(w io.Writer) {
	cmds := compCommands()
	var all []string
	for _, c := range cmds {
		all = append(all, c.names()...)
	}
	fmt.Fprintf(w, `# bash completion for mrfs; made by `+"`mrfs completion bash`"+` from mrfs's own flags.
# Install: mrfs completion bash > /etc/bash_completion.d/mrfs
_mrfs() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local cmd=${COMP_WORDS[1]} first=2
    if (( COMP_CWORD == 1 )); then
        COMPREPLY=($(compgen -W '%s' -- "$cur"))
        return
    fi
    case $cmd in
`, strings.Join(all, " "))
	for _, c := range cmds {
		fmt.Fprintf(w, "    %s)\n", strings.Join(c.names(), "|"))
		if len(c.ops) > 0 {
			fmt.Fprintf(w, "        if (( COMP_CWORD == 2 )); then COMPREPLY=($(compgen -W '%s' -- \"$cur\")); return; fi\n        first=3\n", strings.Join(c.ops, " "))
		}
		if len(c.opts) > 0 {
			fmt.Fprintln(w, "        case $prev in")
			for _, o := range c.opts {
				if o.value == "" {
					continue
				}
				pat := strings.Join(o.dashed(), "|")
				switch valueKind(o) {
				case "choices":
					fmt.Fprintf(w, "        %s) COMPREPLY=($(compgen -W '%s' -- \"$cur\")); return;;\n", pat, strings.Join(o.choices, " "))
				case "file":
					fmt.Fprintf(w, "        %s) compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- \"$cur\")); return;;\n", pat)
				case "mountopts":
					fmt.Fprintf(w, "        %s) local head=; [[ $cur == *,* ]] && head=${cur%%,*},\n", pat)
					fmt.Fprintf(w, "            compopt -o nospace 2>/dev/null; COMPREPLY=($(compgen -P \"$head\" -W '%s' -- \"${cur##*,}\")); return;;\n", strings.Join(mountOptionWords(), " "))
				default:
					fmt.Fprintf(w, "        %s) return;;\n", pat)
				}
			}
			fmt.Fprintln(w, "        esac")
		}
		var flags []string
		for _, o := range c.opts {
			flags = append(flags, o.dashed()...)
		}
		dir, words := c.positional()
		fmt.Fprintf(w, "        if [[ $cur == -* ]]; then COMPREPLY=($(compgen -W '%s' -- \"$cur\"))\n", strings.Join(flags, " "))
		switch {
		case dir:
			fmt.Fprintln(w, `        else compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -d -- "$cur"))`)
		case words != nil:
			fmt.Fprintf(w, "        elif (( COMP_CWORD == first )); then COMPREPLY=($(compgen -W '%s' -- \"$cur\"))\n", strings.Join(words, " "))
		}
		fmt.Fprintln(w, "        fi;;")
	}
	fmt.Fprint(w, `    esac
}
complete -F _mrfs mrfs
`)
}

// fishQuote quotes s for fish: single quotes, with \ and ' escaped.
func fishQuote(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}

func fishCompletion(w io.Writer) {
	cmds := compCommands()
	fmt.Fprintln(w, "# fish completion for mrfs; made by `mrfs completion fish` from mrfs's own flags.")
	fmt.Fprintln(w, "# Install: mrfs completion fish > ~/.config/fish/completions/mrfs.fish")
	fmt.Fprintln(w, "complete -c mrfs -f")
	for _, c := range cmds {
		for _, n := range c.names() {
			fmt.Fprintf(w, "complete -c mrfs -n __fish_use_subcommand -a %s -d %s\n", n, fishQuote(firstSentence(c.summary)))
		}
	}
	for _, c := range cmds {
		cond := "__fish_seen_subcommand_from " + strings.Join(c.names(), " ")
		if len(c.ops) > 0 {
			ops := strings.Join(c.ops, " ")
			fmt.Fprintf(w, "complete -c mrfs -n %s -a %s\n", fishQuote(cond+"; and not __fish_seen_subcommand_from "+ops), fishQuote(ops))
		}
		for _, o := range c.opts {
			var spec []string
			for _, n := range o.names {
				if len(n) == 1 {
					spec = append(spec, "-s "+n)
				} else {
					spec = append(spec, "-l "+n)
				}
			}
			switch valueKind(o) {
			case "choices":
				spec = append(spec, "-x -a "+fishQuote(strings.Join(o.choices, " ")))
			case "file":
				spec = append(spec, "-r -F")
			case "mountopts":
				spec = append(spec, "-x -a "+fishQuote(strings.Join(mountOptionWords(), " ")))
			default:
				if o.value != "" {
					spec = append(spec, "-x")
				}
			}
			fmt.Fprintf(w, "complete -c mrfs -n %s %s -d %s\n", fishQuote(cond), strings.Join(spec, " "), fishQuote(firstSentence(o.usage)))
		}
		switch dir, words := c.positional(); {
		case dir:
			fmt.Fprintf(w, "complete -c mrfs -n %s -a '(__fish_complete_directories (commandline -ct))'\n", fishQuote(cond))
		case words != nil:
			fmt.Fprintf(w, "complete -c mrfs -n %s -a %s\n", fishQuote(cond), fishQuote(strings.Join(words, " ")))
		}
	}
}

// zshQuote quotes s for zsh: single quotes, a ' as '\”.
func zshQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// zshDesc escapes what _arguments reads specially in a description.
func zshDesc(s string) string {
	return strings.NewReplacer(`[`, `\[`, `]`, `\]`, `:`, `\:`).Replace(firstSentence(s))
}

func zshCompletion(w io.Writer) {
	cmds := compCommands()
	fmt.Fprint(w, `#compdef mrfs
# zsh completion for mrfs; made by `+"`mrfs completion zsh`"+` from mrfs's own flags.
# Install: mrfs completion zsh > "${fpath[1]}/_mrfs"
_mrfs() {
  local -a cmds
  cmds=(
`)
	for _, c := range cmds {
		for _, n := range c.names() {
			fmt.Fprintf(w, "    %s\n", zshQuote(n+":"+strings.ReplaceAll(firstSentence(c.summary), ":", `\:`)))
		}
	}
	fmt.Fprint(w, `  )
  if (( CURRENT == 2 )); then
    _describe -t commands 'mrfs command' cmds
    return
  fi
  local cmd=$words[2]
  shift words
  (( CURRENT-- ))
  case $cmd in
`)
	for _, c := range cmds {
		fmt.Fprintf(w, "    %s)\n", strings.Join(c.names(), "|"))
		if len(c.ops) > 0 {
			fmt.Fprintf(w, "      if (( CURRENT == 2 )); then compadd - %s; return; fi\n      shift words\n      (( CURRENT-- ))\n", strings.Join(c.ops, " "))
		}
		var specs []string
		for _, o := range c.opts {
			names := o.dashed()
			var head string
			if len(names) > 1 {
				head = zshQuote("("+strings.Join(names, " ")+")") + "{" + strings.Join(names, ",") + "}"
			} else {
				head = names[0]
			}
			spec := "[" + zshDesc(o.usage) + "]"
			switch valueKind(o) {
			case "choices":
				spec += ":" + o.value + ":(" + strings.Join(o.choices, " ") + ")"
			case "file":
				spec += ":" + o.value + ":_files"
			case "mountopts":
				spec += ":" + o.value + ":(" + strings.Join(mountOptionWords(), " ") + ")"
			default:
				if o.value != "" {
					spec += ":" + o.value + ": "
				}
			}
			if len(names) > 1 {
				specs = append(specs, head+zshQuote(spec))
			} else {
				specs = append(specs, zshQuote(head+spec))
			}
		}
		switch dir, words := c.positional(); {
		case dir:
			specs = append(specs, zshQuote("1:"+c.args+":_directories"))
		case words != nil:
			specs = append(specs, zshQuote("1:"+c.args+":("+strings.Join(words, " ")+")"))
		}
		if len(specs) > 0 {
			fmt.Fprintf(w, "      _arguments \\\n        %s\n", strings.Join(specs, " \\\n        "))
		}
		fmt.Fprintln(w, "      ;;")
	}
	fmt.Fprint(w, `  esac
}
if [[ $funcstack[1] == _mrfs ]]; then _mrfs "$@"; else compdef _mrfs mrfs; fi
`)
}

// firstSentence shortens a usage or summary for a completion menu.
func firstSentence(s string) string {
	for _, sep := range []string{"; ", ". ", " ("} {
		if i := strings.Index(s, sep); i > 0 {
			s = s[:i]
		}
	}
	return strings.TrimSuffix(s, ".")
}
