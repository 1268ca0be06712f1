package ctl

import (
	"flag"
	"fmt"
	"io"
	"strings"

	"aether.io/node/pkg/adminapi"
)

// adminFlags are the flags shared by the subcommands that read the
// agent's admin socket.
type adminFlags struct {
	socket string
	output string
}

func (a *adminFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&a.socket, "admin-socket", adminapi.DefaultSocket, "the agent's admin unix socket")
	fs.StringVar(&a.output, "o", "table", "output format: table or json")
}

// parseAdminFlags parses a subcommand's flags (the shared admin flags plus
// whatever extra registers) and checks them. Flags may come before or after
// the positional arguments (`aetherctl pod ns/name -o json`), which it
// returns; everything after "--" is positional.
func parseAdminFlags(name string, args []string, stdout io.Writer, extra func(*flag.FlagSet)) (adminFlags, []string, error) {
	var f adminFlags
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	f.register(fs)
	if extra != nil {
		extra(fs)
	}
	fs.SetOutput(stdout)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return f, nil, err
	}
	return f, pos, f.check()
}

// parseInterspersed parses fs from args with positional arguments allowed
// between flags, and returns the positional ones in order.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		// flag stops at "--" (dropped) or at the first non-flag: after
		// "--" everything is positional.
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func (a *adminFlags) check() error {
	if a.output != "table" && a.output != "json" {
		return fmt.Errorf("invalid -o %q: want table or json", a.output)
	}
	return nil
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func udsColumn(p adminapi.Pod) string {
	switch {
	case p.UDSRefusal != "":
		return "refused:" + p.UDSRefusal
	case p.UDSPath != "":
		return p.UDSPath
	}
	return "-"
}

func shortID(id string) string {
	if len(id) > 13 {
		return id[:13]
	}
	return id
}

func writeTable(w io.Writer, rows [][]string) {
	widths := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], len(c))
		}
	}
	for _, r := range rows {
		var b strings.Builder
		for i, c := range r {
			if i > 0 {
				b.WriteString("  ")
			}
			if i == len(r)-1 {
				b.WriteString(c)
			} else {
				fmt.Fprintf(&b, "%-*s", widths[i], c)
			}
		}
		fmt.Fprintln(w, b.String())
	}
}

// dash shows an empty value as "-".
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
