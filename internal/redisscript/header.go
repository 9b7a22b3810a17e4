package redisscript

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// Arity is how many KEYS or ARGV a script takes: from Min to Max, Max < 0 for no bound.
type Arity struct {
	Min, Max int
}

// unbounded is the Arity of a function whose header is unknown (a deprecated Lua body).
var unbounded = Arity{Min: 0, Max: -1}

// fits reports whether n is within a.
func (a Arity) fits(n int) bool { return n >= a.Min && (a.Max < 0 || n <= a.Max) }

// String renders a as "3", "2 to 3" or "at least 1".
func (a Arity) String() string {
	switch {
	case a.Max < 0:
		return "at least " + strconv.Itoa(a.Min)
	case a.Min == a.Max:
		return strconv.Itoa(a.Min)
	}
	return strconv.Itoa(a.Min) + " to " + strconv.Itoa(a.Max)
}

// plus returns the Arity of a's fixed part followed by o: the composite of a template
// whose last, open entry is o's.
func (a Arity) plus(o Arity) Arity {
	fixed := a.Max
	if a.Max < 0 {
		fixed = a.Min
	}
	sum := Arity{Min: a.Min + o.Min, Max: fixed + o.Max}
	if o.Max < 0 {
		sum.Max = -1
	}
	return sum
}

// Header is what the leading comment of a .lua file documents (see the package doc for
// its form).
type Header struct {
	// Keys and Args are the KEYS and ARGV the script takes.
	Keys, Args Arity
	// Reply is the header's "Returns ..." line.
	Reply string
	// Invariant is the text after "Invariant:" on its line.
	Invariant string
}

var (
	// entryRE matches a header line that defines KEYS or ARGV, indented by at least two
	// spaces after the "--" (so that prose wrapped onto a line starting "ARGV[2]" is
	// not one): the name, an optional [n] or [n:], and the description.
	entryRE   = regexp.MustCompile(`^--\s{2,}(KEYS|ARGV)(?:\[(\d+)(:?)\])?\s+(\S.*)$`)
	replyRE   = regexp.MustCompile(`^--\s+Returns\b`)
	funcRE    = regexp.MustCompile(`^local function ([A-Za-z_][A-Za-z0-9_]*)\(`)
	invariant = "Invariant:"
)

// ParseHeader reads the header of a .lua file's text src: the lines starting with "--"
// from its top (after a "#!" shebang line, if any). It returns an error naming what is
// missing or malformed.
func ParseHeader(src string) (Header, error) {
	var h Header
	lines := strings.Split(src, "\n")
	if len(lines) > 0 && strings.HasPrefix(lines[0], "#!") {
		lines = lines[1:]
	}
	keys, args := &entryList{name: "KEYS"}, &entryList{name: "ARGV"}
	for _, line := range lines {
		line = strings.TrimRight(line, " \t\r")
		if !strings.HasPrefix(line, "--") {
			break
		}
		if m := entryRE.FindStringSubmatch(line); m != nil {
			l := keys
			if m[1] == "ARGV" {
				l = args
			}
			if err := l.add(m[2], m[3] == ":", m[4]); err != nil {
				return Header{}, err
			}
			continue
		}
		if replyRE.MatchString(line) && h.Reply == "" {
			h.Reply = strings.TrimSpace(strings.TrimPrefix(line, "--"))
		}
		if _, after, ok := strings.Cut(line, invariant); ok && h.Invariant == "" {
			h.Invariant = strings.TrimSpace(after)
		}
	}
	var missing []string
	for _, l := range []*entryList{keys, args} {
		if !l.seen {
			missing = append(missing, l.name+" (\"-- "+l.name+"[1] ...\", or \"-- "+l.name+" none\")")
		}
	}
	if h.Reply == "" {
		missing = append(missing, "the reply (\"-- Returns ...\")")
	}
	if h.Invariant == "" {
		missing = append(missing, "the invariant (\"Invariant: ...\")")
	}
	if len(missing) > 0 {
		return Header{}, fmt.Errorf("header names no %s", strings.Join(missing, ", no "))
	}
	h.Keys, h.Args = keys.arity(), args.arity()
	return h, nil
}

// entryList collects the KEYS or ARGV lines of a header.
type entryList struct {
	name     string
	seen     bool
	none     bool
	n        int  // entries [1..n] so far
	open     bool // the last was [n:]
	optional int  // the first "(optional)" entry, 0 for none
}

func (l *entryList) add(index string, open bool, desc string) error {
	if index == "" {
		if !strings.HasPrefix(desc, "none") || l.seen {
			return fmt.Errorf("header line %q: want %s[n], %s[n:] or %s none", desc, l.name, l.name, l.name)
		}
		l.seen, l.none = true, true
		return nil
	}
	i, _ := strconv.Atoi(index)
	switch {
	case l.none:
		return fmt.Errorf("header names %s none and %s[%d]", l.name, l.name, i)
	case l.open:
		return fmt.Errorf("header names %s[%d] after %s[%d:]", l.name, i, l.name, l.n)
	case i != l.n+1:
		return fmt.Errorf("header names %s[%d] after %s[%d]: number them from 1, in order", l.name, i, l.name, l.n)
	}
	opt := strings.HasPrefix(desc, "(optional)")
	if l.optional > 0 && !opt && !open {
		return fmt.Errorf("header names %s[%d] as required after the optional %s[%d]", l.name, i, l.name, l.optional)
	}
	if opt && l.optional == 0 {
		l.optional = i
	}
	l.seen, l.n, l.open = true, i, open
	return nil
}

func (l *entryList) arity() Arity {
	a := Arity{Min: l.n, Max: l.n}
	if l.optional > 0 {
		a.Min = l.optional - 1
	}
	if l.open {
		a.Min = min(a.Min, l.n-1)
		a.Max = -1
	}
	return a
}

// errLibCode is the error of a library file with code outside its functions.
var errLibCode = errors.New("a library's top level is local function definitions only (each ending with an unindented end)")

// libFunctions returns the names of the local functions code defines, checking that its
// top level (its unindented lines) is comments, "local function name(" and "end" only.
func libFunctions(code string) ([]string, error) {
	var names []string
	for n, line := range strings.Split(code, "\n") {
		line = strings.TrimRight(line, " \t\r")
		switch {
		case line == "", line == "end", strings.HasPrefix(line, "--"), strings.HasPrefix(line, " "), strings.HasPrefix(line, "\t"):
		case funcRE.MatchString(line):
			names = append(names, funcRE.FindStringSubmatch(line)[1])
		default:
			return nil, fmt.Errorf("line %d %q: %w", n+1, line, errLibCode)
		}
	}
	if len(names) == 0 {
		return nil, errors.New("a library defines no local function")
	}
	return names, nil
}
