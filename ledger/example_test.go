package ledger_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/llm"
	"github.com/onceflow/onceflow/llm/fake"
)

// A job handler wraps its model client once; every call names its work (job id and
// step) in IdempotencyKey. The redelivered job replays the recorded answer instead of
// calling (and paying for) the model again.
func ExampleLedger_Wrap() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN) // a database migrated by `onceflow migrate`
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	l, err := ledger.New(pool, ledger.Config{})
	if err != nil {
		log.Fatal(err)
	}
	model := fake.New() // the provider
	client := l.Wrap("fake", model)

	handle := func(jobID string) string {
		resp, err := client.Complete(ctx, &llm.Request{
			Model:          "gpt-4.1-mini",
			Messages:       []llm.Message{{Role: llm.RoleUser, Content: "Summarise: the quarter went well."}},
			IdempotencyKey: ledger.Work(jobID, "summarise"),
		})
		if err != nil {
			log.Fatal(err)
		}
		return resp.ID
	}
	first := handle("job-42")
	again := handle("job-42") // the queue delivered the job again
	fmt.Println("same answer:", first == again)
	fmt.Println("model calls:", model.Calls())
	// Output:
	// same answer: true
	// model calls: 1
}

// With Begin and SucceedTx, the response and the downstream write it causes commit in
// one transaction: both or neither.
func ExampleAttempt_SucceedTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	l, err := ledger.New(pool, ledger.Config{})
	if err != nil {
		log.Fatal(err)
	}
	req := &llm.Request{Model: "gpt-4.1-mini", Messages: []llm.Message{{Role: llm.RoleUser, Content: "Draft the welcome email."}}}
	work := ledger.Work("signup-7", "welcome-email")
	call := ledger.Call{Key: ledger.Key(work, req), Work: work, RequestHash: ledger.RequestHash(req), Provider: "fake", Model: req.Model}

	att, rec, err := l.Begin(ctx, call)
	if err != nil {
		log.Fatal(err)
	}
	if rec == nil { // this attempt owns the call: make it
		resp, err := fake.New().Complete(ctx, req)
		if err != nil {
			_ = att.Fail(ctx, err, ledger.IsAmbiguous(err))
			log.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			log.Fatal(err)
		}
		defer tx.Rollback(ctx)
		rec, _, err = att.SucceedTx(ctx, tx, ledger.ResultOf(resp))
		if err != nil {
			log.Fatal(err)
		}
		// ... write the email's outbox row in tx, from rec ...
		if err := tx.Commit(ctx); err != nil {
			log.Fatal(err)
		}
	}
	row, _ := l.Get(ctx, call.Key)
	fmt.Println(row.State, "in attempt", row.Attempt)
	// Output: succeeded in attempt 1
}

// A caller whose own durable commit follows the answer lets the answer commit without
// waiting for its flush: the later commit's flush makes it durable too. A caller that
// does not commit after all calls Flush.
func ExampleDeferFlush() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	l, err := ledger.New(pool, ledger.Config{})
	if err != nil {
		log.Fatal(err)
	}
	client := l.Wrap("fake", fake.New())
	var answers ledger.Deferred
	resp, err := client.Complete(ledger.DeferFlush(ctx, &answers), &llm.Request{
		Model:          "gpt-4.1-mini",
		Messages:       []llm.Message{{Role: llm.RoleUser, Content: "Summarise: the quarter went well."}},
		IdempotencyKey: ledger.Work("job-43", "summarise"),
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("answered:", resp.Content != "", "waiting for a flush:", answers.Pending())
	// The job's own commit would come here and then answers.Flushed(); without one:
	if err := l.Flush(ctx, &answers); err != nil {
		log.Fatal(err)
	}
	fmt.Println("waiting for a flush:", answers.Pending())
	// Output:
	// answered: true waiting for a flush: true
	// waiting for a flush: false
}

// A caller whose own transaction follows the answer holds it (HoldAnswers) and records
// it in that transaction (Held.Queue on its batch, then Committed): the answer and the
// caller's writes are one commit, as a job's model step and its Commit are.
func ExampleHoldAnswers() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDSN)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	l, err := ledger.New(pool, ledger.Config{})
	if err != nil {
		log.Fatal(err)
	}
	client := l.Wrap("fake", fake.New())
	var held ledger.Held
	req := &llm.Request{
		Model:          "gpt-4.1-mini",
		Messages:       []llm.Message{{Role: llm.RoleUser, Content: "Summarise: the quarter went well."}},
		IdempotencyKey: ledger.Work("job-44", "summarise"),
	}
	resp, err := client.Complete(ledger.HoldAnswers(ctx, &held), req)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("answered:", resp.Content != "", "held:", held.Pending())
	row, _ := l.Get(ctx, ledger.Key(req.IdempotencyKey, req))
	fmt.Println("row:", row.State) // until the caller's commit, as if still in flight

	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx)
	b := &pgx.Batch{}
	// ... the caller's own statements on b, using resp ...
	if _, err := held.Queue(b); err != nil {
		log.Fatal(err)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
	held.Committed()
	row, _ = l.Get(ctx, ledger.Key(req.IdempotencyKey, req))
	fmt.Println("held:", held.Pending(), "row:", row.State)
	// Output:
	// answered: true held: true
	// row: in_flight
	// held: false row: succeeded
}
