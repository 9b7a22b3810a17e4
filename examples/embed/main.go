// Command embed is the smallest program of one's own on the onceflow command: cli.Main
// hosting one workflow (a typed job, its worker, one effect), so that `embed migrate`,
// `embed serve`, `embed work`, `embed relay`, `embed run`, `embed dlq`, `embed audit` and
// the other operator commands run it with every ONCEFLOW_* setting. It links only what
// it imports: no model SDK (ONCEFLOW_LLM=fake only) and none of the onceflow binary's
// demo commands (fake-llm, webhook-sink); see README.md for adding them.
package main

import (
	"context"
	"net/http"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/cli"
	"github.com/onceflow/onceflow/outbox"
)

// Note is the job: its Kind routes it to its worker.
type Note struct {
	Body string `json:"body"`
}

// Kind names the job's kind.
func (Note) Kind() string { return "notes.note" }

// EnqueueOpts puts notes on their queue.
func (Note) EnqueueOpts() onceflow.EnqueueOpts { return onceflow.EnqueueOpts{Queue: "notes"} }

func main() {
	cli.Main(cli.App{Name: "embed", Workflows: func(h cli.Host) ([]onceflow.Workflow, error) {
		sender, err := h.Sender() // ONCEFLOW_SENDER: log, webhook or smtp
		if err != nil {
			return nil, err
		}
		return []onceflow.Workflow{notes(h, sender)}, nil
	}})
}

// notes is the program's one workflow: POST /v1/notes (Idempotency-Key, bearer
// ONCEFLOW_API_KEYS) enqueues a Note, whose worker emits one notes.noted effect.
func notes(h cli.Host, sender outbox.Sender) onceflow.Workflow {
	return onceflow.Workflow{
		Name:    "notes",
		Queues:  map[string]onceflow.QueueConfig{"notes": {}},
		Senders: map[string]outbox.Sender{"notes.": sender},
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Note](func(ctx context.Context, j *onceflow.Job[Note]) error {
				return j.Commit(ctx, func(c *onceflow.Commit) error {
					c.Emit("notes.noted", "noted:"+j.ID, j.Args)
					return nil
				})
			}))
		},
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			route, err := onceflow.Route(c, onceflow.RouteConfig[Note]{Tenant: h.Tenant})
			mux.Handle("POST /v1/notes", route)
			return err
		},
	}
}
