package onceflow_test

// The code of docs/first-workflow.md ("Your first workflow"): the blocks between the
// "doc:" markers are the doc's, verbatim (TestFirstWorkflowDocMirrorsTheExample checks
// it), so the doc cannot drift from code that compiles and runs.

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/idempotency"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fakeserver"
	"github.com/onceflow/onceflow/llm/openai"
	"github.com/onceflow/onceflow/migrations"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/outbox/webhook"
)

// doc: replies.go

// Reply is the job: draft a reply to a support ticket and email it.
type Reply struct {
	Ticket string `json:"ticket"`
	Email  string `json:"email"`
}

// Kind names the job kind; it routes the job to its worker.
func (Reply) Kind() string { return "ticket.reply" }

// draftReply works a Reply: one model call, then the reply row and the email in ONE
// transaction. A redelivered job gets the model's recorded answer (no second call), and
// its Commit writes nothing twice.
func draftReply(ctx context.Context, job *onceflow.Job[Reply]) error {
	step, err := job.Complete(ctx, "draft", &llm.Request{
		Model:    "gpt-4.1-mini",
		Messages: []llm.Message{{Role: llm.RoleUser, Content: "Draft a short, kind reply to:\n" + job.Args.Ticket}},
	})
	if err != nil {
		return err // as it is: onceflow knows which errors to retry
	}
	reply := step.Response.Content
	return job.Commit(ctx, func(c *onceflow.Commit) error {
		c.Exec(`INSERT INTO replies (job_id, body) VALUES ($1, $2)`, job.ID, reply)
		c.Emit("email.reply", "reply:"+job.ID, map[string]string{"to": job.Args.Email, "body": reply})
		c.Result(map[string]string{"reply": reply})
		return nil
	})
}

// tenantOf authenticates a request. Use your own: an API key table, a session.
func tenantOf(r *http.Request) (string, error) {
	if r.Header.Get("Authorization") != "Bearer demo-key" {
		return "", idempotency.ErrUnauthenticated // 401
	}
	return "demo", nil
}

// replies is the workflow: its worker, its email sender, its table and its routes.
func replies(email outbox.Sender, tables migrations.Source) onceflow.Workflow {
	return onceflow.Workflow{
		Name: "replies",
		Workers: func(ws *onceflow.Workers) error {
			return onceflow.AddWorkerSafely(ws, onceflow.WorkFunc[Reply](draftReply))
		},
		Senders:    map[string]outbox.Sender{"email.": email},
		Migrations: &tables,
		Routes: func(c *onceflow.Client, mux *http.ServeMux) error {
			post, err := onceflow.Route(c, onceflow.RouteConfig[Reply]{
				Tenant: tenantOf,
				Validate: func(r *Reply) error {
					if !strings.Contains(r.Email, "@") {
						return errors.New("email: not an address")
					}
					return nil
				},
			})
			if err != nil {
				return err
			}
			mux.Handle("POST /v1/replies", post)
			mux.Handle("GET /v1/replies/{job_id}", onceflow.StateHandler(c, tenantOf))
			return nil
		},
	}
}

// doc: end

//go:embed testdata/replies/*.sql
var replySQL embed.FS

// replyTables are the workflow's migrations (the doc embeds migrations/*.sql).
var replyTables = migrations.Source{FS: replySQL, Dir: "testdata/replies", Table: "replies_migrations"}

// doc: main.go

func firstWorkflowMain() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	dbURL := os.Getenv("ONCEFLOW_DATABASE_URL")
	if _, err := migrations.Up(ctx, dbURL, nil, replyTables); err != nil { // onceflow's tables, then yours
		log.Fatal(err)
	}
	rdb, err := onceflow.NewRedis(os.Getenv("ONCEFLOW_REDIS_URL")) // the settings the guarantees need
	if err != nil {
		log.Fatal(err)
	}
	db, err := onceflow.NewPostgres(ctx, dbURL)
	if err != nil {
		log.Fatal(err)
	}
	email, err := webhook.New(webhook.Config{URL: os.Getenv("EMAIL_WEBHOOK_URL")})
	if err != nil {
		log.Fatal(err)
	}
	client, err := onceflow.NewClient(onceflow.Config{
		Redis:     rdb,
		DB:        db,
		Model:     openai.New(openai.Config{BaseURL: os.Getenv("OPENAI_BASE_URL"), APIKey: os.Getenv("OPENAI_API_KEY")}),
		Workflows: []onceflow.Workflow{replies(email, replyTables)},
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	if err := client.Mount(mux); err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{Addr: "127.0.0.1:8080", Handler: mux, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second}
	go func() {
		if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
			log.Fatal(err)
		}
	}()
	log.Print("listening on ", srv.Addr)
	if err := client.Run(ctx); err != nil { // workers and relay, until Ctrl-C
		log.Fatal(err)
	}
	_ = srv.Shutdown(context.Background())
}

// doc: end

var _ = firstWorkflowMain // compiled, not run: it needs real servers and a signal

// Your first workflow, run: a POST (twice, with one Idempotency-Key), one model call,
// one reply row, one email, and the job's state. The program of docs/first-workflow.md
// is the same code against real servers (firstWorkflowMain).
func Example_firstWorkflow() {
	rdb, prefix, db, done := exampleStores("SELECT 1", replyTables)
	defer done()
	model, err := fakeserver.New(fakeserver.Config{Logger: slog.New(slog.DiscardHandler)}) // fake-llm
	must(err)
	modelSrv := httptest.NewServer(model)
	defer func() { model.Close(); modelSrv.Close() }()
	emails := make(chan string, 10)
	mailSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		emails <- r.Header.Get("Idempotency-Key") + " " + string(body)
	}))
	defer mailSrv.Close()
	email, err := webhook.New(webhook.Config{URL: mailSrv.URL, Body: webhook.PayloadOnly})
	must(err)

	client, err := onceflow.NewClient(onceflow.Config{
		Redis: rdb, DB: db, Prefix: prefix,
		Model:     openai.New(openai.Config{BaseURL: modelSrv.URL + "/v1", APIKey: "fake"}),
		Workflows: []onceflow.Workflow{replies(email, replyTables)},
	})
	must(err)
	mux := http.NewServeMux()
	must(client.Mount(mux))
	api := httptest.NewServer(mux)
	defer api.Close()
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error)
	go func() { stopped <- client.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	post := func() (int, string, string) {
		req, _ := http.NewRequest("POST", api.URL+"/v1/replies", strings.NewReader(`{"ticket": "My parcel never came.", "email": "ann@example.com"}`))
		req.Header.Set("Authorization", "Bearer demo-key")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "ticket-4711-reply")
		resp, err := http.DefaultClient.Do(req)
		must(err)
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(body)
	}
	code, _, body := post()
	fmt.Println(code, body)
	code, replayed, _ := post() // the client retries: same answer, nothing enqueued
	fmt.Println(code, "replayed:", replayed)

	fmt.Println("email:", <-emails)
	var id string
	_, _ = fmt.Sscanf(body, `{"job_id":%q`, &id)
	st := waitDone(client, "demo", id)
	var rows int
	_ = db.QueryRow(ctx, `SELECT count(*) FROM replies`).Scan(&rows)
	fmt.Println(st.Status, "replies:", rows, "model calls:", model.Stats().Requests)
	// Output:
	// 202 {"job_id":"7a0b06d4-eba1-5ed8-bc33-bfd57228b1e6","status":"queued"}
	// 202 replayed: true
	// email: reply:7a0b06d4-eba1-5ed8-bc33-bfd57228b1e6 {"to": "ann@example.com", "body": "Summary ea725376: My parcel never came. (4 words)"}
	// done replies: 1 model calls: 1
}
