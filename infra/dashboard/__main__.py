from spanrl.infra.dashboard.app import main

main()
