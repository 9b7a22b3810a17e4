package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceflow/onceflow/internal/testenv"
	"github.com/onceflow/onceflow/ledger"
	"github.com/onceflow/onceflow/retry"
)

func TestDatabaseErrorsAreRetryable(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), fmt.Sprintf("postgres://onceflow@127.0.0.1:%d/onceflow?sslmode=disable&connect_timeout=1", testenv.FreePort(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	l, _ := ledger.New(pool, ledger.Config{Logger: testenv.Logger(t)})
	_, _, err = l.Begin(ctxT(t), callOf("job-1/s", request("x")))
	if !errors.Is(err, ledger.ErrUnavailable) || !retry.Transient(err) || !retry.Classify(err).Retryable {
		t.Fatalf("Begin with PostgreSQL down: %v (classified %+v), want a retryable ErrUnavailable", err, retry.Classify(err))
	}
}
