package testenv

import (
	"fmt"
	"testing"
)

// ExampleT stands in for the *testing.T a test has, for runnable Examples, which get
// none, so that they can use this package's helpers: a failure panics (the example
// fails with its message), logs are discarded, and Cleanup's functions run at Done.
type ExampleT struct {
	testing.TB // nil: only the methods below are called
	cleanups   []func()
}

// NewExampleT returns an ExampleT; defer its Done.
func NewExampleT() *ExampleT { return &ExampleT{} }

// Helper does nothing.
func (t *ExampleT) Helper() {}

// Name is "Example".
func (t *ExampleT) Name() string { return "Example" }

// Cleanup registers f to run at Done, the last registered first.
func (t *ExampleT) Cleanup(f func()) { t.cleanups = append(t.cleanups, f) }

// Failed is false: a failure has panicked.
func (t *ExampleT) Failed() bool { return false }

// Log discards its arguments.
func (t *ExampleT) Log(...any) {}

// Logf discards its arguments.
func (t *ExampleT) Logf(string, ...any) {}

// Error panics with its arguments.
func (t *ExampleT) Error(args ...any) { panic(fmt.Sprint(args...)) }

// Errorf panics with its message.
func (t *ExampleT) Errorf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }

// Fatal panics with its arguments.
func (t *ExampleT) Fatal(args ...any) { panic(fmt.Sprint(args...)) }

// Fatalf panics with its message.
func (t *ExampleT) Fatalf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }

// Done runs the registered cleanups, the last registered first.
func (t *ExampleT) Done() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}
