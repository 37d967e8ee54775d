from app.cli.main import main

main()
