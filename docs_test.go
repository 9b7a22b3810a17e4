package onceflow_test

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// docs/first-workflow.md shows the code of example_firstworkflow_test.go verbatim: each
// block between a "// doc: NAME" and a "// doc: end" marker of the example file is a
// ```go block of the page (firstWorkflowMain shown as main), so the page's code is code
// that compiles and whose run Example_firstWorkflow checks.
func TestFirstWorkflowDocMirrorsTheExample(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("example_firstworkflow_test.go")
	if err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile("docs/first-workflow.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := map[string]bool{}
	for _, m := range regexp.MustCompile("(?s)```go\n(.*?)\n```").FindAllSubmatch(page, -1) {
		blocks[string(m[1])] = true
	}
	marked := regexp.MustCompile(`(?s)// doc: ([a-z.]+)\n\n(.*?)\n+// doc: end`).FindAllSubmatch(src, -1)
	if len(marked) != 2 {
		t.Fatalf("found %d marked blocks in the example, want 2 (replies.go, main.go)", len(marked))
	}
	for _, m := range marked {
		code := strings.Replace(string(m[2]), "func firstWorkflowMain()", "func main()", 1)
		if !blocks[code] {
			t.Errorf("docs/first-workflow.md does not show the example's %s block verbatim:\n%s", m[1], code)
		}
	}
}

// The shell commands of docs/first-workflow.md work in a new module as written: the
// module is tidied (its go.sum gets the imports' modules) before its first `go run .`,
// and the onceflow command is never run from inside the user's module (`go run
// github.com/onceflow/onceflow/cmd/onceflow` there needs the command's own dependencies
// in the user's go.mod).
func TestFirstWorkflowShellStepsWorkInANewModule(t *testing.T) {
	t.Parallel()
	page, err := os.ReadFile("docs/first-workflow.md")
	if err != nil {
		t.Fatal(err)
	}
	var cmds []string
	for _, m := range regexp.MustCompile("(?s)```sh\n(.*?)\n```").FindAllStringSubmatch(string(page), -1) {
		for _, line := range strings.Split(m[1], "\n") {
			line, _, _ = strings.Cut(line, "#")
			if line = strings.TrimSpace(line); line != "" {
				cmds = append(cmds, line)
			}
		}
	}
	tidy, run := slices.Index(cmds, "go mod tidy"), slices.Index(cmds, "go run .")
	if run < 0 || tidy < 0 || tidy > run {
		t.Errorf("the page runs its program (at command %d) without tidying its module first (at %d): %q", run, tidy, cmds)
	}
	for _, c := range cmds {
		if strings.HasPrefix(c, "go run github.com/onceflow/onceflow/cmd/") {
			t.Errorf("the page runs the onceflow command from inside the user's module: %q", c)
		}
	}
}

// The README's example is code of example_firstworkflow_test.go: each ```go block of
// README.md, split at lines reading "// ...", is made of runs of the example's lines
// (compared without indentation, blank lines ignored), in the example's order. So the
// front door shows code that compiles and whose run Example_firstWorkflow checks.
func TestReadmeExampleIsTheFirstWorkflowsCode(t *testing.T) {
	src, err := os.ReadFile("example_firstworkflow_test.go")
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	example := trimmedLines(string(src))
	blocks := regexp.MustCompile("(?s)```go\n(.*?)\n```").FindAllStringSubmatch(string(readme), -1)
	if len(blocks) == 0 {
		t.Fatal("README.md shows no ```go block")
	}
	for _, b := range blocks {
		from := 0
		for _, run := range strings.Split(b[1], "// ...\n") {
			lines := trimmedLines(run)
			at := indexOfRun(example[from:], lines)
			if at < 0 {
				t.Errorf("README.md shows lines that are not, in this order, lines of example_firstworkflow_test.go:\n%s", run)
				break
			}
			from += at + len(lines)
		}
	}
}

// trimmedLines returns s's lines without their surrounding spaces, blank lines left out.
func trimmedLines(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// indexOfRun returns where run starts in lines, or -1.
func indexOfRun(lines, run []string) int {
	for i := 0; i+len(run) <= len(lines); i++ {
		if slices.Equal(lines[i:i+len(run)], run) {
			return i
		}
	}
	return -1
}

// Every relative link of README.md, CHANGELOG.md, docs/*.md and the examples' READMEs
// (inline links, images and reference definitions, outside code) points at a file or folder of the repository,
// and a #fragment at a heading of the Markdown file it names (GitHub's anchors).
func TestDocLinksResolve(t *testing.T) {
	pages := []string{"README.md", "CHANGELOG.md"}
	for _, pattern := range []string{"docs/*.md", "examples/*/README.md"} {
		more, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, more...)
	}
	anchors := map[string]map[string]bool{}
	anchorsOf := func(page string) map[string]bool {
		if a, ok := anchors[page]; ok {
			return a
		}
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		a := headingAnchors(string(b))
		anchors[page] = a
		return a
	}
	link := regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)|(?m)^\[[^\]]+\]:\s*(\S+)`)
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(withoutCode(string(b)), -1) {
			target := m[1] + m[2]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, fragment, _ := strings.Cut(target, "#")
			file := page
			if path != "" {
				file = filepath.Join(filepath.Dir(page), path)
				if _, err := os.Stat(file); err != nil {
					t.Errorf("%s links to %s: no such file", page, target)
					continue
				}
			}
			if fragment == "" {
				continue
			}
			if !strings.HasSuffix(file, ".md") {
				t.Errorf("%s links to %s: a fragment of a file that is not Markdown", page, target)
				continue
			}
			if !anchorsOf(file)[fragment] {
				t.Errorf("%s links to %s: %s has no heading with that anchor", page, target, file)
			}
		}
	}
}

var (
	fencedCode = regexp.MustCompile("(?ms)^ *```.*?^ *```[^\n]*$")
	codeSpan   = regexp.MustCompile("`[^`\n]*`")
	heading    = regexp.MustCompile(`(?m)^#{1,6}\s+(.+?)\s*#*\s*$`)
	linkTarget = regexp.MustCompile(`\]\([^)]*\)`)
)

// withoutCode blanks fenced code blocks and code spans out of a Markdown page, so that
// their contents are not read as links or headings.
func withoutCode(page string) string {
	return codeSpan.ReplaceAllString(fencedCode.ReplaceAllString(page, ""), "``")
}

// headingAnchors returns the anchors GitHub gives the headings of a Markdown page: the
// heading's text in lower case, without punctuation but hyphens and underscores, spaces
// made hyphens; a repeated anchor gets -1, -2, ...
func headingAnchors(page string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(fencedCode.ReplaceAllString(page, ""), -1) {
		text := linkTarget.ReplaceAllString(m[1], "]") // a link's text only
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteByte('-')
			}
		}
		anchor := b.String()
		if n := seen[anchor]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", anchor, n)] = true
		} else {
			anchors[anchor] = true
		}
		seen[anchor]++
	}
	return anchors
}

// The docs describe the attempt budget as docs/queue.md "Attempts and retries" does: a
// count of failed attempts with a full-jitter backoff (RetryBase, RetryMax), not a
// delivery budget bounded by ClaimIdle; and Job.Delivery (job.go) is the attempt number
// across entries (1 + the attempts spent; a retry is a new entry, a snooze keeps the
// number), not a count of one stream entry's deliveries.
func TestDocsDescribeTheAttemptBudget(t *testing.T) {
	t.Parallel()
	for file, stale := range map[string]string{
		"docs/coming-from-river-asynq.md": "`MaxDeliveries` and `ClaimIdle` bound how often and how soon a job runs again",
		"job.go":                          "Delivery counts the deliveries of this job's stream entry",
	} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.Join(strings.Fields(strings.ReplaceAll(string(b), "//", "")), " "), stale) {
			t.Errorf("%s still says %q", file, stale)
		}
	}
}
